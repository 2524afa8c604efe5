"""bias_gelu side by side: each available fastbert backend, the naive reference, torch's F.gelu.

Run: .venv/bin/python -m pytest benchmarks/test_bias_gelu.py --benchmark-columns=median,iqr,rounds
Shapes are BERT-base intermediate activations: [tokens, 3072].
"""
import pytest
import torch

from fastbert import dispatch, ops
from fastbert.ops import reference

SHAPES = [(1024, 3072), (4096, 3072)]
DTYPES = [torch.float32, torch.bfloat16]


def contenders():
    yield "torch F.gelu(x + b)", lambda x, b: torch.nn.functional.gelu(x + b)
    yield "reference", reference.bias_gelu
    for backend in ("cpu",):
        if not dispatch.machine_reasons(backend) and backend in dispatch.implementations("bias_gelu"):
            def run(x, b, backend=backend):
                with dispatch.use_backend(backend, op="bias_gelu"):
                    return ops.bias_gelu(x, b)
            yield f"fastbert {backend}", run


CONTENDERS = list(contenders())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name,fn", CONTENDERS, ids=[n for n, _ in CONTENDERS])
def test_bias_gelu(benchmark, name, fn, shape, dtype):
    x = torch.randn(*shape).to(dtype)
    b = torch.randn(shape[-1]).to(dtype)
    benchmark.group = f"bias_gelu {shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}"
    benchmark.extra_info["GB moved"] = 2 * x.numel() * x.element_size() / 1e9
    with torch.inference_mode():
        benchmark(fn, x, b)
