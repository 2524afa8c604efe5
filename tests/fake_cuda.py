"""A pytest plugin for the GPU check's dry run (benchmarks/gpu_check.sh --dry-run) on a machine without a
GPU: it pretends one is there and runs the GPU stages' selection to the first CUDA contact. A test that
builds its tensors on the GPU stops at that (CPU-only torch: "Torch not compiled with CUDA enabled"); a test
that hands CPU tensors to the cuda or triton backend (or launches a Triton kernel on them) stops at this
plugin's FakeCudaViolation, and the run fails naming it: on the GPU it would fail or test the wrong thing.
A test failing any other way fails the run too.

    PYTHONPATH=tests python -m pytest -p fake_cuda -k "cuda and not properties" tests/ops ...
"""
import pytest
import torch

GPU_BACKENDS = ("cuda", "triton")
GPU_TENSORS = "Torch not compiled with CUDA enabled"


class FakeCudaViolation(Exception):
    """CPU tensors reached a GPU backend or kernel (not an AssertionError: pytest.raises(AssertionError) in a
    test must not swallow it)."""


def _violation(excinfo):
    """The FakeCudaViolation in the exception's chain (torch.library.opcheck and torch.compile re-raise
    wrapped), or None."""
    e, seen = excinfo.value if excinfo is not None else None, set()
    while e is not None and id(e) not in seen:
        if isinstance(e, FakeCudaViolation):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _pretend_a_gpu():
    from fastbert import dispatch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    machine_reasons = dispatch.machine_reasons
    dispatch.machine_reasons = lambda backend: () if backend in GPU_BACKENDS else machine_reasons(backend)
    call = dispatch.call

    def guarded_call(op, inputs, *args, **kwargs):
        cpu = [t for t in inputs.get("tensors", ()) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        backend = dispatch.select(op, inputs)[0] if cpu else None
        if backend in GPU_BACKENDS:
            raise FakeCudaViolation(f"{op}: the {backend} backend got CPU tensors {[tuple(t.shape) for t in cpu]}")
        return call(op, inputs, *args, **kwargs)

    dispatch.call = guarded_call
    try:
        from fastbert.kernels import _launch
    except ImportError:  # no triton: its tests skip
        return
    on_device_of = _launch.on_device_of

    def guarded_on_device_of(t):
        if t.device.type == "cpu":
            raise FakeCudaViolation(f"a Triton kernel launched on a CPU tensor {tuple(t.shape)}")
        return on_device_of(t)

    _launch.on_device_of = guarded_on_device_of


_pretend_a_gpu()  # on import (-p loads it before any conftest): a device chosen at import time sees the GPU too


def pytest_configure(config):
    config._fake_cuda = {"gpu tensors": [], "violations": [], "other failures": [], "passed": [], "skipped": []}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seen = item.config._fake_cuda
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            seen["skipped"].append(item.nodeid)
        elif report.passed:
            seen["passed"].append(item.nodeid)
        elif _violation(call.excinfo) is not None:
            seen["violations"].append(f"{item.nodeid}: {_violation(call.excinfo)}")
        elif call.excinfo is not None and GPU_TENSORS in str(call.excinfo.value):
            seen["gpu tensors"].append(item.nodeid)
        else:
            seen["other failures"].append(f"{item.nodeid}: {call.excinfo.typename if call.excinfo else report.longrepr}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    seen = config._fake_cuda
    terminalreporter.write_sep("=", "fake CUDA")
    terminalreporter.write_line(", ".join(f"{len(v)} {k}" for k, v in seen.items()))
    for kind in ("violations", "other failures", "passed"):  # passed: never touched CUDA, worth a look
        for line in seen[kind]:
            terminalreporter.write_line(f"{kind}: {line}")


def pytest_sessionfinish(session, exitstatus):
    # Every test stops at its first CUDA tensor by design; a violation or any other failure fails the run.
    seen = session.config._fake_cuda
    session.exitstatus = 1 if seen["violations"] or seen["other failures"] else 0
