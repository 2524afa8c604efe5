"""The per-machine measurements behind dispatch's choice among a backend's variants.

Where a backend has more than one implementation of an op (the cpu backend's own kernel, oneDNN's,
torch's built-in), the fastest differs from CPU to CPU: on a Xeon with AMX torch's SDPA runs bfloat16
attention on tiles and beats a kernel tuned on AMD; on AMD the reverse. So the first eager call of each
(op, variant key) times every variant that can serve it on the call's own inputs, keeps the fastest, and
writes it to a cache file per machine, so the next process never measures again. FASTBERT_CPU_TUNE=0 turns
measuring off (each op's static default runs); FASTBERT_CACHE_DIR moves the cache. Ops that read a
layer's weights time their inference calls each after a sweep of the caches (evict), since a model's
forward meets those weights out of cache.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

try:
    import fcntl  # POSIX: the cache file's merges take turns
except ImportError:
    fcntl = None

import torch

from fastbert import environment

REPEATS = 5  # timed calls per variant (after one warm-up); the median decides
BUILTIN = "torch"  # the variant that is torch's own built-in (F.linear, SDPA), where an op has one
BUILTIN_MARGIN = 0.03  # ... which another variant replaces only when this much faster: no op may run slower
# than the built-in it replaces, and medians within a few percent are the machine's noise. Measured (a Xeon
# with AMX, fp32 training's FFN-in linear): onednn+torch_backward timed 1.9% faster than torch in tuning, and
# the training step ran 1.5% slower with it (benchmarks/RESULTS.md, nineteenth session).
_lock = threading.Lock()


def enabled() -> bool:
    value = environment.get("FASTBERT_CPU_TUNE", "1").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"FASTBERT_CPU_TUNE must be 0 (the static defaults) or 1 (measure), got {value!r}")
    return value == "1"


def cache_path() -> Path:
    root = os.environ.get("FASTBERT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "fastbert")
    return Path(root) / "variants.json"


ISA_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                "amx_int8")


def cpu() -> dict:
    """The CPU's model name and which of ISA_FEATURES it has (from /proc/cpuinfo; empty elsewhere)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "features": [f for f in ISA_FEATURES if f in flags]}


@functools.lru_cache(maxsize=None)
def cpu_features() -> frozenset[str]:
    """cpu()'s features, read once."""
    return frozenset(cpu()["features"])


_CACHES = "/sys/devices/system/cpu/cpu0/cache"


@functools.lru_cache(maxsize=None)
def cache_bytes(level: int) -> int | None:
    """The size of one CPU's level-`level` cache (data or unified) from sysfs; None where it cannot be read."""
    try:
        for index in sorted(os.listdir(_CACHES)):
            with open(os.path.join(_CACHES, index, "level")) as f:
                if f.read().strip() != str(level):
                    continue
            with open(os.path.join(_CACHES, index, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(_CACHES, index, "size")) as f:
                size = f.read().strip().upper()
            return int(size.rstrip("KMB")) * (1 << 20 if size.endswith("M") else 1 << 10 if size.endswith("K") else 1)
    except (OSError, ValueError):
        pass
    return None


@functools.lru_cache(maxsize=None)
def build() -> str:
    """Which compiled kernels a measurement timed: fastbert._C's size and modification time, hashed (a
    rebuild, a kernel changed under the same version number, measures afresh); "none" without _C."""
    try:
        spec = importlib.util.find_spec("fastbert._C")
    except (ImportError, ValueError):  # an import hook that refuses it: no build to name
        spec = None
    if spec is None or spec.origin is None or not os.path.exists(spec.origin):
        return "none"
    stat = os.stat(spec.origin)
    return hashlib.sha1(f"{stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=None)
def _machine_base() -> str:
    try:
        version = importlib.metadata.version("fastbert")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    c = cpu()
    return f"{c['model']} [{' '.join(c['features'])}] torch {torch.__version__} fastbert {version} build {build()}"


def machine() -> str:
    """What a measurement holds for: the CPU, its features, the versions, the build and the thread count."""
    return f"{_machine_base()} {torch.get_num_threads()} threads ({platform.machine()})"


def _other_build(key: str) -> bool:
    """Whether a cache file's `key` is this machine's (any thread count) under another build of _C."""
    here = _machine_base()
    prefix = here[:here.rindex(" build ")]
    return key.startswith(prefix + " build ") and not key.startswith(here + " ")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: arrays nested past Python's stack
        return {}
    return data if isinstance(data, dict) else {}


def _valid(entry) -> bool:
    """An entry as choose() writes it (a file edited by hand or by another version may hold anything)."""
    return (isinstance(entry, dict) and isinstance(entry.get("choice"), str) and isinstance(entry.get("ms"), dict)
            and all(isinstance(ms, (int, float)) and 0 <= ms < 1e9 for ms in entry["ms"].values()))  # not NaN,
    # inf or an integer past float's range (fastest() would raise on it at every call)


def _mine(data: dict) -> dict:
    """This machine's table in the cache file's `data` (made empty if it holds something else)."""
    if not isinstance(data.get(machine()), dict):
        data[machine()] = {}
    return data[machine()]


# machine() -> its entries, each read once from the cache file (machine() names the thread count, which
# torch.set_num_threads may change: each count has its own measurements).
_tables: dict[str, dict[str, dict]] = {}


def entries() -> dict[str, dict]:
    """{variant key: {"choice": name, "ms": {name: median ms}}} measured on this machine so far."""
    here = machine()
    with _lock:
        if here not in _tables:
            _tables[here] = {key: entry for key, entry in _mine(_read(cache_path())).items() if _valid(entry)}
        return dict(_tables[here])


def forget() -> None:
    """Drop what this process remembers (the file stays): for tests that change the cache directory."""
    with _lock:
        _tables.clear()


def _store(key: str, entry: dict) -> None:
    path = cache_path()
    with _lock:
        if machine() in _tables:  # forget() may have run since entries() read it
            _tables[machine()][key] = entry
        tmp = None
        try:  # merge with what other processes wrote since, then replace the file in one step
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.parent / ".variants.lock", "a") as lock:
                if fcntl is not None:  # processes merge in turn: none drops what another just wrote
                    fcntl.flock(lock, fcntl.LOCK_EX)
                data = _read(path)
                for stale in [k for k in data if k != machine() and _other_build(k)]:
                    del data[stale]  # this machine's tables from builds since replaced: never read again
                _mine(data)[key] = entry
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".variants-")
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
        except OSError:  # a read-only home: the choice still holds for this process
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)


def _run(fn, args, backward: bool) -> None:
    out = fn(*args)
    if backward:  # training: the variant's backward counts as much as its forward
        out = out if isinstance(out, torch.Tensor) else out[0]
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        torch.autograd.grad(out.float().sum(), leaves, allow_unused=True)


EVICT_CAP = 256 << 20  # evict()'s sweep at most: a server's whole L3 would cost more than it tells


def sweep_buffer() -> torch.Tensor:
    """A buffer as large as the last-level cache (at most EVICT_CAP, at least twice the L2s of the threads
    in use): evict() reads it."""
    l2s = 2 * (cache_bytes(2) or 1 << 21) * torch.get_num_threads()
    return torch.ones(min(max(cache_bytes(3) or 0, l2s), EVICT_CAP) // 4)


def evict(sweep: torch.Tensor) -> None:
    """Push what the caches hold out to memory by reading `sweep` (sweep_buffer()). A model's forward meets
    each layer's weights after all the other layers' passed through the caches: BERT-base's 170 MB of
    bfloat16 weights come from memory, where (a Xeon with AMX, 128 rows) the own GEMM runs the QKV
    projection in 0.77x oneDNN's time and in L3 or L2 in 0.95-1.04x (benchmarks/RESULTS.md)."""
    sweep.sum()


def warm_all_but_weights(fn, args: tuple) -> None:
    """After evict(), warm again what a forward has warm when an op that reads weights runs: its rows (the
    first argument, [..., K]: the op before just wrote them) and its Python and dispatch path, by a call of
    `fn` on none of the rows, which reads no weights (cold, that path added ~200-300 us to each variant's
    400-700: benchmarks/RESULTS.md). Nothing where the first argument is no tensor."""
    rows = args[0]
    if isinstance(rows, torch.Tensor) and rows.dim() > 0:
        rows.sum()
        fn(rows.reshape(-1, rows.shape[-1])[:0], *args[1:])


def _medians_ms(candidates: dict, args, backward: bool, repeats: int = REPEATS,
                cold: bool = False) -> dict[str, float]:
    """Each candidate's median ms over `repeats` calls, in alternating rounds: a disturbance that comes and
    goes (another process's threads, the clock) falls on all of them, not on whichever ran first. Each timed
    call comes right after an untimed one of the same candidate, so that it gets back the memory its own
    outputs just freed, as an op does from one layer to the next: after another candidate's frees the
    allocator may have returned those pages to the OS, and the timed call paid for faulting them in again
    (own GEMM, bf16 8192 x 384 -> 1536: 34.5 ms after torch's variant, 26 alone; benchmarks/RESULTS.md).
    `cold`: each timed call after evict() and warm_all_but_weights()."""
    times = {name: [] for name in candidates}
    sweep = sweep_buffer() if cold else None
    if backward:  # leaves of the trials' own: a backward through the call's tensors would free the caller's graph
        args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
    # What the trials save stays theirs: inside a checkpointed region it would join the region's records,
    # and the recomputation (which finds the choice made and runs no trials) would not match them.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), (
            torch.enable_grad() if backward else torch.no_grad()):
        for fn in candidates.values():
            _run(fn, args, backward)  # warm-up: packing, first-touch allocations
        for _ in range(repeats):
            for name, fn in candidates.items():
                _run(fn, args, backward)
                if sweep is not None:
                    evict(sweep)
                    warm_all_but_weights(fn, args)
                start = time.perf_counter()
                _run(fn, args, backward)
                times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


def fastest(times: dict[str, float]) -> str:
    """The name with the least time ({name: ms}); the built-in unless another beats it by BUILTIN_MARGIN."""
    best = min(times, key=times.get)
    if BUILTIN in times and times[best] > (1 - BUILTIN_MARGIN) * times[BUILTIN]:
        return BUILTIN
    return best


def choose(key: str, candidates: dict, args, backward: bool, repeats: int = REPEATS, cold: bool = False) -> str:
    """The name of the fastest of `candidates` ({name: fn}) for `key`: from the cache, or timed now on `args`
    (forward and, with `backward`, the backward of the output's sum; `repeats` timed calls each, with
    `cold` each after evict() and warm_all_but_weights())."""
    entry = entries().get(key)
    # Kept while it measured every one of these candidates (a variant added since, or newly usable, is
    # measured); the fastest of them, where this call can use fewer than were measured.
    measured = entry.get("ms", {}) if entry is not None else {}
    if measured and set(candidates) <= set(measured):
        return fastest({name: measured[name] for name in candidates})
    # Each trial may pack weights into the owner's PreparedWeights; the losers' forms would stay there
    # for good (a second copy of every weight), so what the trials made is dropped after.
    # The random stream is put back too: a trial that draws (a dropout seed) must not make a measuring run's
    # results differ from a cached one's under the same torch.manual_seed.
    owners = [(a, a.snapshot()) for a in args if hasattr(a, "snapshot") and hasattr(a, "restore")]
    rng = torch.get_rng_state()
    try:
        times = _medians_ms(candidates, args, backward, repeats, cold)
    finally:
        torch.set_rng_state(rng)
        for owner, snapshot in owners:
            owner.restore(snapshot)
    best = fastest(times)
    _store(key, {"choice": best, "ms": {name: round(ms, 4) for name, ms in times.items()}})
    return best
