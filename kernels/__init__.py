"""fastbert.kernels: Triton kernels and their launch helpers (no policy: dispatch decides).

Kept free of side effects: transformers imports any top-level `kernels` module it can find.
"""
