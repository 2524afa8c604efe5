"""fastbert in other libraries' models (transformers, sentence-transformers)."""
