import os

os.environ.setdefault("TRITON_INTERPRET", "0")
