"""The package's shape: no import cycles (a deferred import inside a function counts too), and the library never imports its applications (fastbert.apps)."""
import ast
import pathlib

import fastbert

ROOT = pathlib.Path(fastbert.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    """fastbert's modules: Python files, and compiled extensions (fastbert._C), which import none."""
    out = {f"fastbert.{p.name.split('.')[0]}": None for p in ROOT.glob("*.so")}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: pathlib.Path, known, top_level_only: bool) -> set[str]:
    """fastbert modules `path` imports; `from pkg import sub` counts as the submodule, not the package."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    deps = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fastbert"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            deps |= subs if len(subs) == len(node.names) else {node.module, *subs}
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names} & set(known)
    return deps & set(known)  # fastbert.kernels lives in kernels/ (and imports no fastbert module)


def test_no_import_cycles():
    known = modules()
    graph = {m: imports(p, known, top_level_only=False) - {m} if p else set() for m, p in known.items()}  # deferred imports too
    cycles = []

    def walk(m, stack):
        for d in graph[m]:
            if d in stack:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            else:
                walk(d, stack + [d])

    for m in graph:
        walk(m, [m])
    assert not cycles, "import cycles: " + "; ".join(sorted(set(cycles)))


def test_the_library_never_imports_its_applications():
    known = modules()
    offenders = {m: sorted(d for d in imports(p, known, top_level_only=False) if d.startswith("fastbert.apps"))
                 for m, p in known.items() if p and not m.startswith("fastbert.apps") and m != "fastbert.__main__"}
    assert not {m: d for m, d in offenders.items() if d}, offenders
