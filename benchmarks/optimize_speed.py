"""fastbert.optimize() on a SentenceTransformer: encode() before and after, alternating, medians.

    .venv/bin/python benchmarks/optimize_speed.py
"""
import fastbert
from sentence_transformers import SentenceTransformer
from fastbert.apps.demo import SENTENCES, minilm_dir
from fastbert.apps.timing import alternating_medians
sentences = [f"{s} ({i})" if i % 2 else s * (1 + i % 3) for i in range(8) for s in SENTENCES]  # 64, lengths vary
plain = SentenceTransformer(minilm_dir(), device="cpu")
fast = fastbert.optimize(SentenceTransformer(minilm_dir(), device="cpu"))
a = fast.encode(sentences, batch_size=32, convert_to_tensor=True, normalize_embeddings=True)
b = plain.encode(sentences, batch_size=32, convert_to_tensor=True, normalize_embeddings=True)
print("min cosine", float((a * b).sum(-1).min()))
ms = alternating_medians({"optimized": lambda: fast.encode(sentences, batch_size=32),
                          "plain": lambda: plain.encode(sentences, batch_size=32)}, rounds=7)
o, p = ms["optimized"], ms["plain"]
print(f"encode 64 sentences, batch 32: optimized {o:.1f} ms, plain {p:.1f} ms, speedup {p / o:.2f}x")
