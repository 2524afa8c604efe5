"""Which backend runs each op: the only place in fastbert that makes that choice.

Every op has one implementation per backend. A backend answers `not_supported_reasons(op, inputs)`
in words; selection walks the op's priority list and takes the first backend with no reasons.
`reference` always qualifies, so there is always an answer. A backend forced by `FASTBERT_BACKEND`,
`FASTBERT_BACKEND_<OP>` or `use_backend(...)` that cannot serve raises `BackendUnavailable` with its
reasons; it never falls back silently. Decisions read only static properties (device, dtype, shapes,
flags), so they hold under torch.compile.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import operator
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from fastbert import environment, tuning
from fastbert.records import Call, is_muted, muted, note, record  # noqa: F401  (fastbert.dispatch.record() is public)

logger = logging.getLogger("fastbert")

BACKENDS = ("cuda", "triton", "cpu", "reference")  # default priority, best first
OPS = ("qkv_projection", "attention", "varlen_attention", "bias_gelu", "dense", "add_layer_norm", "quantized_dense")


class BackendUnavailable(RuntimeError):
    """A forced backend cannot serve a call; the message lists its reasons."""


@dataclass(frozen=True)
class Support:
    """What one backend's implementation of one op accepts."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None = None  # None: any
    dropout: bool = True  # can it apply dropout itself
    probabilities: bool = False  # can it return attention probabilities (output_attentions)
    quantized_output: bool = False  # can it also return its output quantized per row, for an int8 GEMM


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------------
# Backends: what each needs from the machine (built or importable), independent of any call.


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken build must not break `import fastbert`
        return f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return None


@functools.lru_cache(maxsize=None)
def machine_reasons(backend: str) -> tuple[str, ...]:
    """Why `backend` cannot run on this machine at all; empty when it can."""
    if backend == "reference":
        return ()
    if backend == "triton":
        err = _import_error("triton")
        if err:
            return (f"triton does not import: {err}",)
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            return ("no CUDA GPU, and the Triton interpreter is off (set TRITON_INTERPRET=1 before import)",)
        return ()
    if backend in ("cpu", "cuda"):
        err = _import_error("fastbert._C")
        if err:
            return (f"fastbert._C was not built: {err}",)
        if backend == "cuda":
            from fastbert import _C

            if not getattr(_C, "WITH_CUDA", False):
                return ("fastbert._C was built without CUDA (needs a CUDA toolkit and a CUDA build of torch)",)
        return ()
    raise ValueError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")


# --------------------------------------------------------------------------------------------------
# The registry: op -> backend -> (implementation, support). Op modules register themselves.


@dataclass(frozen=True)
class Impl:
    fn: Callable
    support: Support
    extra_reasons: Callable[["Facts"], list[str]] | None = None  # op-specific checks beyond Support


_REGISTRY: dict[str, dict[str, Impl]] = {op: {} for op in OPS}


def register(op: str, backend: str, support: Support, extra_reasons=None):
    """Decorator: `fn` implements `op` on `backend` for inputs that `support` describes."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")

    def wrap(fn):
        _REGISTRY[op][backend] = Impl(fn, support, extra_reasons)
        _VARIANTS.pop((op, backend), None)
        _choices.clear()
        _generation[0] += 1
        return fn

    return wrap


def implementations(op: str) -> dict[str, Impl]:
    return dict(_REGISTRY[op])


@contextlib.contextmanager
def scratch_registry():
    """Inside the block register() may put stand-in backends in; afterwards the registry is as it was,
    and remembered choices and logged fallbacks are forgotten (for tests)."""
    saved, saved_variants = {op: dict(impls) for op, impls in _REGISTRY.items()}, dict(_VARIANTS)
    _logged.clear()
    try:
        yield
    finally:
        for op, impls in saved.items():
            _REGISTRY[op].clear()
            _REGISTRY[op].update(impls)
        _VARIANTS.clear()
        _VARIANTS.update(saved_variants)
        _choices.clear()
        _picked.clear()
        _logged.clear()
        _generation[0] += 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Facts:
    """The static facts of a call that selection may depend on (so it holds under torch.compile)."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    head_dim: int | None = None
    dropout: bool = False  # dropout_p > 0: only whether, not how much, may steer the choice
    need_weights: bool = False
    quantize_output: bool = False
    gelu: bool = False  # a linear with a GELU epilogue
    row_width: int | None = None  # a row op's last dimension (kernels that hold a row in registers have a limit)


def facts(inputs: dict) -> Facts:
    """`inputs`: `tensors` (the call's tensor arguments) and flags `head_dim`, `dropout_p`, `need_weights`,
    `quantize_output`, `gelu`, `row_width`; `dtypes`: floating dtypes the call computes in beyond its tensors'."""
    tensors = [t for t in inputs.get("tensors", ()) if t is not None]
    return Facts(
        devices=tuple(sorted({t.device.type for t in tensors})),
        dtypes=tuple(sorted({t.dtype for t in tensors if t.is_floating_point()} | set(inputs.get("dtypes", ())), key=str)),
        head_dim=inputs.get("head_dim"),
        dropout=True if inputs.get("dropout_p", 0.0) > 0 else False,  # a branch: dynamo specializes it
        need_weights=bool(inputs.get("need_weights", False)),
        quantize_output=bool(inputs.get("quantize_output", False)),
        gelu=bool(inputs.get("gelu", False)),
        row_width=inputs.get("row_width"),
    )


def not_supported_reasons(op: str, backend: str, inputs: dict | Facts, forced: bool = False) -> list[str]:
    """Why `backend` cannot run `op` on `inputs` (a dict as `facts` takes, or Facts), in words;
    empty when it can."""
    f = inputs if isinstance(inputs, Facts) else facts(inputs)
    impl = _REGISTRY[op].get(backend)
    if impl is None:
        return [f"{backend} has no {op} implementation yet"]
    reasons = list(machine_reasons(backend))
    if reasons:
        return reasons
    s = impl.support
    bad_devices = sorted(set(f.devices) - set(s.devices))
    if bad_devices:
        reasons.append(f"tensors on {', '.join(bad_devices)} (supported: {', '.join(s.devices)})")
    if backend == "triton" and f.devices == ("cpu",) and "cpu" in s.devices and not forced:
        # The interpreter is a correctness tool, ~10^4 x slower than torch: only when asked for.
        reasons.append("CPU tensors run through the Triton interpreter only when triton is forced")
    for dt in f.dtypes:
        if dt not in s.dtypes:
            reasons.append(f"dtype {_dtype_name(dt)} (supported: {', '.join(map(_dtype_name, s.dtypes))})")
    if s.head_dims is not None and f.head_dim is not None and f.head_dim not in s.head_dims:
        reasons.append(f"head_dim {f.head_dim} (supported: {', '.join(map(str, s.head_dims))})")
    if f.dropout and not s.dropout:
        reasons.append("dropout_p > 0 (this backend has no dropout)")
    if f.need_weights and not s.probabilities:
        reasons.append("output_attentions needs the attention probabilities, which this backend never materializes")
    if f.quantize_output and not s.quantized_output:
        reasons.append("quantize_output (this backend cannot return its output as QuantizedRows)")
    if impl.extra_reasons is not None:
        reasons.extend(impl.extra_reasons(f))
    if not reasons:
        reasons.extend(_variant_reasons(op, backend, f))
    return reasons


# --------------------------------------------------------------------------------------------------
# Overrides: environment variables, and the use_backend(...) / use_variant(...) blocks open in this context:
# context variables, not a thread's list, so that asyncio tasks sharing a thread see only their own blocks
# (a task's block, closed while another task's was open, popped the other's entry: that task ran on the
# backend it had not forced).

_local = threading.local()


def _thread_plan():
    """This thread's running plan, if any. Never read while compiling: no plan runs in compiled code, and a
    read made torch.compile guard on the thread's state (the first call's exit set it: every model compiled
    twice)."""
    return None if torch.compiler.is_compiling() else getattr(_local, "plan", None)
_backend_blocks: contextvars.ContextVar[tuple[tuple[str, str | None], ...]] = contextvars.ContextVar(
    "fastbert_use_backend", default=())
_variant_blocks: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "fastbert_use_variant", default=())


def _override_stack() -> tuple[tuple[str, str | None], ...]:
    return _backend_blocks.get()


@contextlib.contextmanager
def _opened(blocks: contextvars.ContextVar, entry: tuple):
    blocks.set(blocks.get() + (entry,))
    try:
        yield
    finally:  # this block's own entry (blocks closed out of order keep the others')
        blocks.set(tuple(e for e in blocks.get() if e is not entry))


def _check_backend_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return name


@contextlib.contextmanager
def use_backend(backend: str, op: str | None = None):
    """Force `backend` for every op, or for `op` only, inside the block (this thread or asyncio task)."""
    _check_backend_name(backend, "use_backend")
    if op is not None and op not in OPS:
        raise ValueError(f"use_backend: unknown op {op!r} (known: {', '.join(OPS)})")
    with _opened(_backend_blocks, (backend, op)):
        yield


_BACKEND_VARIABLES = {op: (f"FASTBERT_BACKEND_{op.upper()}", "FASTBERT_BACKEND") for op in OPS}
_VARIANT_VARIABLE = {op: f"FASTBERT_VARIANT_{op.upper()}" for op in OPS}


def forced_backend(op: str) -> tuple[str, str] | None:
    """(backend, where it was forced) for `op`, innermost context first, then environment."""
    for backend, only in reversed(_override_stack()):
        if only is None or only == op:
            return backend, "use_backend()"
    for var in _BACKEND_VARIABLES[op]:
        value = environment.get(var)
        if value:
            return _check_backend_name(value.strip().lower(), var), var
    return None


# --------------------------------------------------------------------------------------------------
# Selection.

_logged: set[tuple[str, str]] = set()


def _log_fallback_once(op: str, skipped: dict[str, list[str]]) -> None:
    text = "; ".join(f"{b}: {', '.join(r)}" for b, r in skipped.items())
    if (op, text) in _logged or torch.compiler.is_compiling():
        return
    _logged.add((op, text))
    logger.warning("fastbert: %s falls back to the reference (%s)", op, text)


# Eager calls remember each choice: the same op on the same kinds of tensors under the same override
# always gets the same answer while the registry stands (register() empties it). A forced backend
# that cannot serve raises each time instead of being remembered.
_choices: dict[tuple, tuple] = {}  # key -> (backend, skipped, usable variants, key)


def select(op: str, inputs: dict | Facts) -> tuple[str, dict[str, list[str]]]:
    """The backend that runs `op` on `inputs`, and the reasons of each backend passed over."""
    return _selection(op, inputs)[:2]


def _selection(op: str, inputs: dict | Facts) -> tuple[str, dict[str, list[str]], tuple["Variant", ...], tuple]:
    """select()'s answer, the backend's variants that can serve the call, and the call's cache key."""
    if isinstance(inputs, dict) and not torch.compiler.is_compiling():
        # torch.device, not .type: the key is built on every call and .type costs a string each time.
        key = (op, tuple([(t.device, t.dtype) for t in inputs.get("tensors", ()) if t is not None]), inputs.get("dtypes"),
               inputs.get("head_dim"), inputs.get("dropout_p", 0.0) > 0, bool(inputs.get("need_weights", False)),
               bool(inputs.get("quantize_output", False)), bool(inputs.get("gelu", False)), inputs.get("row_width"),
               forced_backend(op), forced_variant(op))
        choice = _choices.get(key)
        if choice is None:
            f = facts(inputs)
            backend, skipped = _select_uncached(op, f)
            choice = _choices[key] = (backend, skipped, usable_variants(op, backend, f)[0], key)
        return choice
    f = inputs if isinstance(inputs, Facts) else facts(inputs)
    backend, skipped = _select_uncached(op, f)
    names = _usable_names(op, backend, f.devices, tuple(_dtype_name(d) for d in f.dtypes), f.head_dim, f.dropout,
                          f.need_weights, f.quantize_output, f.gelu, f.row_width)
    table = _VARIANTS.get((op, backend))
    return backend, skipped, tuple(v for v in table.options if v.name in names) if table else (), None


@torch.compiler.assume_constant_result
def _usable_names(op, backend, devices, dtype_names, head_dim, dropout, need_weights, quantize_output,
                  gelu, row_width) -> tuple[str, ...]:
    """usable_variants' names, as a constant while tracing (its checks call functions dynamo skips)."""
    f = Facts(devices, tuple(getattr(torch, d) for d in dtype_names), head_dim, dropout, need_weights, quantize_output,
              gelu, row_width)
    return tuple(v.name for v in usable_variants(op, backend, f)[0])


def _select_uncached(op: str, f: Facts) -> tuple[str, dict[str, list[str]]]:
    dtypes = tuple(_dtype_name(d) for d in f.dtypes)
    return _select(op, f.devices, dtypes, f.head_dim, f.dropout, f.need_weights, f.quantize_output, f.gelu,
                   f.row_width)


# Under torch.compile the choice is made once, while tracing, and baked into the graph: it reads
# only static facts (passed as plain constants) and the overrides in force at that moment.
@torch.compiler.assume_constant_result
def _select(op, devices, dtype_names, head_dim, dropout, need_weights, quantize_output,
            gelu, row_width) -> tuple[str, dict[str, list[str]]]:
    f = Facts(devices, tuple(getattr(torch, d) for d in dtype_names), head_dim, dropout, need_weights, quantize_output,
              gelu, row_width)
    forced = forced_backend(op)
    if forced is not None:
        backend, where = forced
        reasons = not_supported_reasons(op, backend, f, forced=True)
        if reasons:
            raise BackendUnavailable(
                f"{op}: backend {backend!r} was forced ({where}) but cannot serve this call: " + "; ".join(reasons)
            )
        return backend, {}
    skipped: dict[str, list[str]] = {}
    for backend in BACKENDS:
        reasons = not_supported_reasons(op, backend, f)
        if not reasons:
            # Backends that serve other devices are not a fallback worth telling anyone about.
            relevant = {b: r for b, r in skipped.items()
                        if _REGISTRY[op].get(b) and set(f.devices) & set(_REGISTRY[op][b].support.devices)}
            if backend == "reference" and relevant:
                _log_fallback_once(op, relevant)
            return backend, skipped
        skipped[backend] = reasons
    raise AssertionError("unreachable: the reference backend always qualifies")


def prefers_varlen(x: torch.Tensor, head_dim: int, dropout_p: float) -> bool:
    """Whether the model should run padding-free: a kernel, not the reference's per-sequence loop,
    would serve varlen_attention. Eager only (the padding check that precedes it reads values). A
    backend or variant forced for varlen_attention that cannot serve raises, as at any call."""
    if torch.compiler.is_compiling():
        return False
    backend, _ = select("varlen_attention", {"tensors": (x,), "head_dim": head_dim, "dropout_p": dropout_p})
    return backend != "reference"


def call(op: str, inputs: dict, *args, **kwargs):
    """Select a backend for `op` (and of its variants, where it has several), run it, and record the choice."""
    plan = _thread_plan()
    if plan is not None and plan.replaying:
        planned = plan.take(op)  # the op's trusted() matched this call to the plan's
        if planned is not None:
            fn, backend, skipped, variant = planned
            note(op, backend, skipped, variant)
            return fn(*args, **kwargs)
    backend, skipped, usable, key = _selection(op, inputs)
    if not usable:
        fn, variant = _REGISTRY[op][backend].fn, None
    else:
        chosen = _choose_variant(op, backend, usable, key, args)
        fn, variant = chosen.fn, chosen.name
    if plan is not None and plan.recording and not is_muted():
        plan.remember(op, fn, backend, skipped, variant)  # before running it: calls it makes come after
    note(op, backend, skipped, variant)
    return fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Plans: a model's eager inference forward, run again without its checks and choices. The first forward
# of a kind (Plans.key: its inputs' shapes, dtypes and flags) runs as usual and remembers each op call's
# implementation; a later forward of that kind skips the public ops' checks (their inputs have the shapes
# and dtypes those checks passed) and calls the remembered implementation. At a batch of one the checks
# and choices cost as much as the kernels (benchmarks/RESULTS.md). Each public op names itself, its first
# tensor's shape and dtype and its flags (`trusted`); where they differ from the plan's, the plan is
# dropped and the rest of the forward runs checked.


class Plans:
    """A model's plans by key. All are forgotten when dispatch's state changes (the registry, selections
    cleared, tuning switched) or a module, parameter or buffer of a planned model is assigned; one is dropped
    when a tensor of the model is not the one it ran with (another object or storage: a conversion,
    `.data =`, torch.func.functional_call)."""

    LIMIT = 64  # plans a model keeps: ragged batches make a key per token count
    _epoch = [0]  # bumped when a module of a planned model is assigned to
    _watched: "weakref.WeakSet" = weakref.WeakSet()  # the modules of models that have plans

    def __init__(self):
        self._plans: dict = {}
        self._state = None
        self._lock = threading.Lock()  # two threads may record for one model at once
        if not Plans._epoch[0]:
            Plans._epoch[0] = 1
            for register in (torch.nn.modules.module.register_module_module_registration_hook,
                             torch.nn.modules.module.register_module_parameter_registration_hook,
                             torch.nn.modules.module.register_module_buffer_registration_hook):
                register(Plans._assigned)

    @staticmethod
    def _assigned(module, *_):
        if module in Plans._watched:  # (modules being built, and other models', are not)
            Plans._epoch[0] += 1

    @staticmethod
    def key(model, *facts):
        """The key of a forward of `model` with `facts` (its inputs' shapes, dtypes, flags), or None where
        no plan serves: training, gradients, autocast, torch.compile or torch.func, forced backends."""
        if (model.training or torch.is_grad_enabled() or torch.compiler.is_compiling() or _any_autocast()
                or torch._C._functorch.peek_interpreter_stack() is not None):
            return None
        if _override_stack() or _override_variants() or any(environment.get(v) for v in _FORCING_VARIABLES):
            return None  # forced: rare, and then every call is checked
        return facts

    def run(self, model, key):
        """Context for the forward under `key`: replays its plan, or records one; with key None neither
        (and an outer model's plan does not reach the ops inside)."""
        if key is None:
            return contextlib.nullcontext() if torch.compiler.is_compiling() else _Unplanned()  # (_thread_plan)
        state = _state()
        with self._lock:
            if state != self._state:
                self._plans.clear()
                self._state = state
            plan = self._plans.get(key)
        if plan is _UNPLANNABLE:
            return _Unplanned()
        if plan is not None and plan.current():
            return _Running(self, key, plan, state)
        return _Running(self, key, _Plan(model), state, recording=True)

    def keep(self, key, plan, state_before) -> None:
        with self._lock:
            now = _state()
            # The forward's own new selections leave the other plans valid; any other change does not.
            if now[:3] != state_before[:3] or now[3] < state_before[3] or now[4] < state_before[4]:
                self._plans.clear()
                return
            if key not in self._plans and len(self._plans) >= self.LIMIT:
                self._plans.pop(next(iter(self._plans)))  # the oldest
            self._plans[key] = plan
            self._state = now
        if plan is not _UNPLANNABLE:
            Plans._watched.update(plan.modules)

    def drop(self, key) -> None:
        with self._lock:
            self._plans.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __deepcopy__(self, memo):
        return Plans()  # a copy's tensors are others

    def __reduce__(self):
        return (Plans, ())


_FORCING_VARIABLES = ("FASTBERT_BACKEND", *(v for op in OPS
                                             for v in (_BACKEND_VARIABLES[op][0], _VARIANT_VARIABLE[op])))
_generation = [0]  # bumped whenever the registry changes
_UNPLANNABLE = object()  # a key whose forward makes a call that no op named (then it always runs checked)


def _state() -> tuple:
    """What every plan's choices depend on beyond its key."""
    return (tuning.enabled(), _generation[0], Plans._epoch[0], len(_choices), len(_picked),
            torch.get_num_threads())  # what is fastest depends on the threads (tuning.machine)


class _Plan:
    def __init__(self, model):
        self.calls: list[tuple] = []  # (signature, fn, backend, skipped, variant)
        # A block's first call -> [its module, the call after its last, its program: _UNBUILT, None or built]
        self.blocks: dict[int, list] = {}
        self.modules = tuple(model.modules())
        # Each parameter and buffer: where it is held, the tensor, and where its data was when recorded.
        slots = [(held, name, t) for m in self.modules for held in (m._parameters, m._buffers)
                 for name, t in held.items() if t is not None]
        self.places = [(held, name) for held, name, _ in slots]
        self.tensors = [t for _, _, t in slots]
        self.pointers = [t.data_ptr() for t in self.tensors]

    def current(self) -> bool:
        """Whether the model holds the tensors it ran with, on the same storage (a conversion or `.data =`
        moves it; a `.data =` of the very address in another shape is what clear_prepared_weights is for).
        List comprehensions: ~20 us for BERT-base's 199 tensors, a loop with branches took 50."""
        return (all(map(operator.is_, [held.get(name) for held, name in self.places], self.tensors))
                and [t.data_ptr() for t in self.tensors] == self.pointers)


class _Unplanned:
    """Context: no plan on this thread inside (a model without one, called within another's forward)."""

    def __enter__(self):
        self.outer, _local.plan = getattr(_local, "plan", None), None

    def __exit__(self, *_):
        _local.plan = self.outer


class _Running:
    """One forward's use of a plan on this thread: replaying it, or recording it (kept on success)."""

    def __init__(self, plans: Plans, key, plan, state, recording: bool = False):
        self.plans, self.key, self.plan, self.state, self.recording = plans, key, plan, state, recording
        self.replaying, self.position, self.signature, self.broken, self.armed = not recording, 0, None, False, False

    def __enter__(self):
        self.outer = getattr(_local, "plan", None)
        _local.plan = self
        return self

    def __exit__(self, kind, *_):
        _local.plan = self.outer
        if kind is None and self.recording:
            self.plans.keep(self.key, _UNPLANNABLE if self.broken else self.plan, self.state)

    def trusted(self, signature: tuple) -> bool:
        if self.recording:
            if not is_muted():  # a variant's trial run (tuning) is no part of the forward
                self.signature = signature
            return False
        calls = self.plan.calls
        if self.replaying and self.position < len(calls) and calls[self.position][0] == signature:
            self.armed = True
            return True
        self.abandon()
        return False

    def take(self, op: str) -> tuple | None:
        """The implementation (fn, backend, skipped, variant) of this call of `op`, which trusted() matched;
        None (and the plan dropped) where no trusted() came first."""
        call = self.plan.calls[self.position] if self.armed else None
        if call is None or call[0][0] != op:
            self.abandon()
            return None
        self.armed, self.position = False, self.position + 1
        return call[1:]

    def abandon(self) -> None:
        """This forward goes another way: the rest runs checked, and the plan is dropped."""
        if self.replaying:
            self.replaying = self.armed = False
            self.plans.drop(self.key)

    def remember(self, op, fn, backend, skipped, variant) -> None:
        if self.signature is None or self.signature[0] != op:
            self.broken = True  # a call whose op did not name itself: such a forward is never replayed
        self.plan.calls.append((self.signature, fn, backend, skipped, variant))
        self.signature = None


_UNBUILT = object()  # a block whose program is yet to be built
RETRY = object()  # a block's build: no program now, try again at the block's next replay


class block:
    """Context for `module`'s forward within a planned forward. Recording, the op calls it makes are kept
    as one block. Replaying, it gives a function that runs them in one call: `build(module, calls)` (the
    block's records, as _Plan.calls holds them) makes a program that takes the forward's arguments, once
    per plan (None where it cannot, RETRY where it cannot yet); while the program's `current()` holds, the
    function runs it, notes the block's calls as dispatch.record() would have seen them, and moves the plan
    past them. Else it gives None and the forward runs op by op."""

    __slots__ = ("module", "build", "running", "start", "end")

    def __init__(self, module, build: Callable):
        self.module, self.build, self.running = module, build, None

    def __enter__(self):
        running = self.running = _thread_plan()
        if running is None:
            return None
        if running.recording:
            self.start = len(running.plan.calls)
            return None
        entry = running.plan.blocks.get(running.position) if running.replaying and not running.armed else None
        if entry is None or entry[0] is not self.module:
            return None
        if entry[2] is _UNBUILT:
            built = self.build(self.module, running.plan.calls[running.position:entry[1]])
            if built is RETRY:
                return None
            entry[2] = built
        program = entry[2]
        if program is None:
            return None
        if not program.current():  # stale (weights written, settings changed): this forward runs op by op
            entry[2] = _UNBUILT
            return None
        self.start, self.end = running.position, entry[1]
        return functools.partial(self._run, program)

    def _run(self, program, *args):
        out = program(*args)
        running = self.running
        for signature, _, backend, skipped, variant in running.plan.calls[self.start:self.end]:
            note(signature[0], backend, skipped, variant)
        running.position = self.end
        return out

    def __exit__(self, kind, *_):
        running = self.running
        if running is not None and running.recording and kind is None and not is_muted():
            running.plan.blocks[self.start] = [self.module, len(running.plan.calls), _UNBUILT]


def trusted(op: str, x: torch.Tensor, *flags) -> bool:
    """Whether this call of public op `op` may skip its checks: a plan is replaying and its next call is
    `op` with a first tensor `x` of this shape and dtype and these `flags` (the non-tensor arguments that
    steer the op's checks and choices)."""
    plan = _thread_plan()
    return plan is not None and plan.trusted((op, x.shape, x.dtype, *flags))


# --------------------------------------------------------------------------------------------------
# Variants: a backend's alternative implementations of one op (the cpu backend's own kernel, oneDNN's,
# torch's built-in), each parity-tested like a backend. Which one runs is chosen per kind of call:
# forced (use_variant(), FASTBERT_VARIANT_<OP>), else the fastest as measured once on this machine
# (fastbert/tuning.py; FASTBERT_CPU_TUNE=0: no measuring), else the first that can serve (the static
# default; a variant `preferred` on this CPU goes first). Only eager calls measure; while tracing for
# torch.compile the static default is baked in.


@dataclass(frozen=True)
class Variant:
    name: str
    fn: Callable
    reasons: Callable[[Facts], list[str]] | None = None  # why it cannot serve a call (machine or call facts)
    preferred: Callable[[Facts], bool] | None = None  # the static default where true (by the CPU's features)
    training_only: bool = False  # differs from another variant only in its backward: not timed for inference


@dataclass(frozen=True)
class Variants:
    options: tuple[Variant, ...]  # the static default first
    bucket: Callable[..., tuple]  # the call's arguments -> its shape class: one measurement per class
    weights: bool = False  # the op reads weights (its first argument the rows): inference calls are timed with
    # them out of cache (tuning.evict, tuning.warm_all_but_weights)


_VARIANTS: dict[tuple[str, str], Variants] = {}
_picked: dict[tuple, Variant] = {}  # (selection key, bucket, training, threads) -> the variant measured fastest
# One measurement at a time in a process: threads calling an op at once each measured it (each timing taken
# beside the others' trials), and each ran its own pick, so one input gave other outputs thread to thread.
# Reentrant: a trial's ops measure what they call in the same thread.
_measuring = threading.RLock()


def register_variants(op: str, backend: str, options, bucket, weights: bool = False) -> None:
    """`backend`'s implementations of `op` (Variant, static default first) replace its registered
    function at call time; `bucket(*args)` is a call's shape class; `weights`: the op reads a layer's
    weights, which a model's forward meets out of cache, so inference calls are timed so (its first
    argument must be its rows [..., K]: tuning.warm_all_but_weights)."""
    if backend not in _REGISTRY[op]:
        raise ValueError(f"register {op}'s {backend} backend before its variants")
    _VARIANTS[(op, backend)] = Variants(tuple(options), bucket, weights)
    _choices.clear()
    _picked.clear()
    _generation[0] += 1


def size_class(n: int) -> int:
    """The power of two at or above n: calls of sizes in one class share a measurement."""
    return 1 << max(int(n) - 1, 0).bit_length()


def variant_names(op: str, backend: str | None = None) -> tuple[str, ...]:
    """`backend`'s variants of `op`; without a backend, every backend's (sorted)."""
    if backend is None:
        return tuple(sorted({v.name for (o, _), t in _VARIANTS.items() if o == op for v in t.options}))
    table = _VARIANTS.get((op, backend))
    return tuple(v.name for v in table.options) if table else ()


def usable_variants(op: str, backend: str, f: Facts) -> tuple[tuple[Variant, ...], dict[str, list[str]]]:
    """The variants of `backend` that can serve a call with facts `f` (empty where it has none), and why
    each other cannot. A forced variant that cannot serve raises BackendUnavailable."""
    table = _VARIANTS.get((op, backend))
    if table is None:
        forced, known = forced_variant(op), variant_names(op)
        if forced is not None and forced[0] not in known:  # a misspelt name, not a choice another backend serves
            raise BackendUnavailable(f"{op}: variant {forced[0]!r} was forced ({forced[1]}) but no backend has it "
                                     f"({', '.join(known) if known else f'{op} has no variants'})")
        return (), {}
    why = {v.name: v.reasons(f) for v in table.options if v.reasons is not None}
    usable = tuple(v for v in table.options if not why.get(v.name))
    usable = tuple(sorted(usable, key=lambda v: not (v.preferred is not None and v.preferred(f))))  # (stable)
    forced = forced_variant(op)
    if forced is not None:
        name, where = forced
        if name not in variant_names(op, backend):
            raise BackendUnavailable(f"{op}: variant {name!r} was forced ({where}) but {backend} has only "
                                     f"{', '.join(variant_names(op, backend))}")
        if why.get(name):
            raise BackendUnavailable(f"{op}: variant {name!r} was forced ({where}) but cannot serve this call: "
                                     + "; ".join(why[name]))
        usable = tuple(v for v in usable if v.name == name)
    return usable, {name: r for name, r in why.items() if r}


def _variant_reasons(op: str, backend: str, f: Facts) -> list[str]:
    """Why none of `backend`'s variants can serve (then the backend cannot); empty otherwise."""
    table = _VARIANTS.get((op, backend))
    if table is None or forced_variant(op) is not None:
        return []
    usable, why = usable_variants(op, backend, f)
    return [] if usable else [f"{name}: {', '.join(r)}" for name, r in why.items()]


def _choose_variant(op: str, backend: str, usable: tuple[Variant, ...], key, args) -> Variant:
    if len(usable) == 1 or key is None or torch.compiler.is_compiling() or not tuning.enabled():
        return usable[0]
    training = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    table = _VARIANTS[(op, backend)]
    bucket = table.bucket(*args)
    pick = (key, bucket, training, torch.get_num_threads())
    picked = _picked.get(pick)
    if picked is not None:
        return picked
    if not training:
        usable = tuple(v for v in usable if not v.training_only) or usable
        if len(usable) == 1:
            picked = _picked[pick] = usable[0]
            return picked
    with _measuring:
        picked = _picked.get(pick)  # another thread's, measured while this one waited
        if picked is None:
            dtypes = "/".join(sorted({_dtype_name(d) for _, d in key[1] if d.is_floating_point}))
            cold = table.weights and not training
            phase = "train" if training else "infer cold" if cold else "infer"
            name = f"{op} {backend} {dtypes} {phase} " + " ".join(map(str, bucket))
            with muted():  # the trial runs are not calls anyone made
                best = tuning.choose(name, {v.name: v.fn for v in usable}, args, training, cold=cold)
            picked = _picked[pick] = next(v for v in usable if v.name == best)
    return picked


def _override_variants() -> tuple[tuple[str, str], ...]:
    return _variant_blocks.get()


@contextlib.contextmanager
def use_variant(op: str, name: str):
    """Force variant `name` of whichever backend runs `op` inside the block (this thread or asyncio task)."""
    if op not in OPS:
        raise ValueError(f"use_variant: unknown op {op!r} (known: {', '.join(OPS)})")
    with _opened(_variant_blocks, (op, name)):
        yield


def forced_variant(op: str) -> tuple[str, str] | None:
    """(variant, where it was forced) for `op`: the innermost use_variant(), then FASTBERT_VARIANT_<OP>."""
    for only, name in reversed(_override_variants()):
        if only == op:
            return name, "use_variant()"
    var = _VARIANT_VARIABLE[op]
    value = environment.get(var)
    return (value.strip().lower(), var) if value else None


# torch's own check (nn.RNN uses it); where a torch lacks it, every call looks at its tensors' device.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def follows_autocast(public_op=None, *, in_float32: bool = False):
    """Decorator for the public ops: under torch.autocast an op runs whole in the autocast dtype
    (statistics stay fp32 inside the kernels), or with `in_float32` in float32, as autocast runs
    layer_norm (the residual stream then stays float32, as in transformers under autocast). Floating
    inputs are cast once, before any check, and the op runs with autocast off."""
    if public_op is None:
        return functools.partial(follows_autocast, in_float32=in_float32)

    @functools.wraps(public_op)
    def wrapper(*args, **kwargs):
        if not _any_autocast():  # one call, not a search for the device: a batch of one runs ~50 ops
            return public_op(*args, **kwargs)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = first.device.type if first is not None else None
        if device is None or not torch.is_autocast_enabled(device):
            return public_op(*args, **kwargs)
        dtype = torch.float32 if in_float32 else torch.get_autocast_dtype(device)
        cast = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
        with torch.autocast(device, enabled=False):
            return public_op(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})

    return wrapper
