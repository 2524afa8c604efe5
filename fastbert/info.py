"""`python -m fastbert info`: which backend can run which op on this machine, and why not."""
from __future__ import annotations

import platform

import torch

from fastbert import dispatch
from fastbert.tuning import ISA_FEATURES, cpu  # noqa: F401  (info.cpu is public)


def cpu_line() -> str:
    c = cpu()
    return f"CPU: {c['model']} ({', '.join(c['features']) or 'no AVX2 or later'})"


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}[dtype]


def backend_cell(op: str, backend: str) -> str:
    impl = dispatch.implementations(op).get(backend)
    if impl is None:
        return "not implemented"
    reasons = dispatch.machine_reasons(backend)
    if reasons:
        return "unavailable"
    s = impl.support
    return f"yes ({'/'.join(s.devices)}; {' '.join(_short(d) for d in s.dtypes)})"


def table() -> str:
    header = ["op", *dispatch.BACKENDS]
    rows = [[op, *(backend_cell(op, b) for b in dispatch.BACKENDS)] for op in dispatch.OPS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def report() -> str:
    import fastbert

    lines = [
        f"fastbert {fastbert.__version__} | torch {torch.__version__} | python {platform.python_version()} | "
        f"{platform.machine()}, {torch.get_num_threads()} threads | CUDA GPU: "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "none"),
        cpu_line(),
        "",
        table(),
        "",
        "Backends this machine cannot run, and why:",
    ]
    unavailable = [(b, dispatch.machine_reasons(b)) for b in dispatch.BACKENDS if dispatch.machine_reasons(b)]
    lines += [f"  {b}: {'; '.join(r)}" for b, r in unavailable] or ["  (none)"]
    try:
        from fastbert import _C

        lines.append(f"fastbert._C: built for CPU_CAPABILITY={_C.CPU_CAPABILITY}, AVX512_BF16={getattr(_C, 'AVX512_BF16', '?')} "
                     f"(bfloat16 attention on bf16 dot products), CUDA={_C.WITH_CUDA}")
    except Exception:
        pass
    lines.append("Priority (first that can serve a call wins): " + " > ".join(dispatch.BACKENDS))
    lines.append("Force with FASTBERT_BACKEND=<backend>, FASTBERT_BACKEND_<OP>=<backend> or fastbert.use_backend(...).")
    lines += ["", *settings_report(), ""]
    try:
        lines += variants_report()
    except (ValueError, dispatch.BackendUnavailable) as e:  # a setting the lines above name
        lines.append(f"Variants of the cpu backend: cannot be listed ({e})")
    return "\n".join(lines)


def settings_report() -> list[str]:
    """The FASTBERT_* environment variables set, each checked as a call would check it: info is what a
    user runs to find out why calls fail."""
    import os

    from fastbert import tuning

    names = sorted(n for n in os.environ if n.startswith("FASTBERT_"))
    lines = ["Settings: " + (", ".join(f"{n}={os.environ[n]}" for n in names) if names else "none (FASTBERT_*)")]
    problems = []
    for check in [tuning.enabled] + [lambda op=op: dispatch.forced_backend(op) for op in dispatch.OPS]:
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    ignored = [f"{name} names no op ({', '.join(prefix + op.upper() for op in dispatch.OPS)})"
               for name in names for prefix in ("FASTBERT_BACKEND_", "FASTBERT_VARIANT_")
               if name.startswith(prefix) and name[len(prefix):].lower() not in dispatch.OPS]  # (_GELU: the op is bias_gelu)
    for op in dispatch.OPS:
        forced, known = dispatch.forced_variant(op), dispatch.variant_names(op)
        if forced is not None and forced[0] not in known:
            problems.append(f"{forced[1]}: {op} has no variant {forced[0]!r} ({', '.join(known) or 'none'})")
    return (lines + [f"  calls raise: {p}" for p in dict.fromkeys(problems)]
            + [f"  ignored (no call reads it): {p}" for p in ignored])


def variants_report() -> list[str]:
    """The cpu backend's variants per op, which this machine can run, and what measuring chose so far."""
    from fastbert import tuning

    lines = ["Variants of the cpu backend (static default first; the fastest is measured once per kind of call "
             f"and cached: {'on' if tuning.enabled() else 'off, FASTBERT_CPU_TUNE=0'}; cache {tuning.cache_path()}):"]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for op in dispatch.OPS:
        names = dispatch.variant_names(op, "cpu")
        if names:
            # As for a call with GELU: variants for GELU calls only are listed, not refused.
            why = {d: dispatch.usable_variants(op, "cpu", dispatch.Facts(("cpu",), (t,), gelu=True))[1]
                   for d, t in dtypes.items()}
            cells = []
            for name in names:
                serves = [d for d in dtypes if name not in why[d]]
                if not serves:
                    reasons = sorted({r for d in dtypes for r in why[d][name]})
                    cells.append(f"{name} (unavailable: {'; '.join(reasons)})")
                else:
                    cells.append(name + ("" if len(serves) == len(dtypes) else f" ({'/'.join(serves)} only)"))
            lines.append(f"  {op}: {', '.join(cells)}")
    lines.append("  Force one with FASTBERT_VARIANT_<OP>=<variant> or fastbert.dispatch.use_variant(op, variant).")
    measured = tuning.entries()
    lines.append(f"Measured on this machine ({tuning.machine()}): " + ("none yet" if not measured else ""))
    for key, entry in sorted(measured.items()):
        times = ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(entry.get("ms", {}).items()))
        lines.append(f"  {key}: {entry.get('choice')} ({times})")
    return lines
