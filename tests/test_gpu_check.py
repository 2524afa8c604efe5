"""benchmarks/gpu_check.sh's dry run rests on tests/fake_cuda.py: it must fail a test that hands CPU tensors
to a GPU backend, and pass one that builds its tensors on the GPU."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def run_fake_cuda(tmp_path):
    def run(body: str):
        (tmp_path / "test_probe.py").write_text(textwrap.dedent(body))
        env = dict(os.environ, PYTHONPATH=TESTS, TRITON_INTERPRET="0")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rN", "--tb=no", "-p", "no:cacheprovider",
                               "-p", "fake_cuda", str(tmp_path / "test_probe.py")],
                              capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        return done.returncode, done.stdout

    return run


def test_cpu_tensors_at_a_gpu_backend_fail_the_dry_run(run_fake_cuda):
    rc, out = run_fake_cuda("""
        import torch
        from fastbert import dispatch, ops

        def test_cpu_tensors_to_triton():
            x = torch.randn(4, 8)
            with dispatch.use_backend("triton"):
                ops.bias_gelu(x, torch.randn(8))
    """)
    assert rc == 1, out
    assert "1 violations" in out and "the triton backend got CPU tensors" in out, out


def test_gpu_tensors_pass_the_dry_run(run_fake_cuda):
    if torch.cuda.is_available():
        pytest.skip("a real GPU: the probe runs instead of stopping at its first GPU tensor")
    rc, out = run_fake_cuda("""
        import torch
        from fastbert import dispatch, ops

        def test_gpu_tensors_to_cuda():
            x = torch.randn(4, 8, device="cuda")
            with dispatch.use_backend("cuda"):
                ops.bias_gelu(x, torch.randn(8, device="cuda"))
    """)
    assert rc == 0, out
    assert "1 gpu tensors, 0 violations" in out, out


def test_a_wrapped_violation_fails_the_dry_run(run_fake_cuda):
    """torch.library.opcheck re-raises what went wrong inside it: the violation in the chain still counts."""
    rc, out = run_fake_cuda("""
        import torch
        from fastbert import dispatch, ops

        def test_wrapped():
            try:
                with dispatch.use_backend("triton"):
                    ops.bias_gelu(torch.randn(4, 8), torch.randn(8))
            except Exception as e:
                raise RuntimeError("wrapped") from e
    """)
    assert rc == 1 and "1 violations" in out, out
