"""The import graph of mtp_core/ and cli/: no cycles among files, and nothing imports up.

Every .py file under mtp_core/ and cli/ is parsed (never imported) and each of its imports, at module level or
inside a function, absolute or relative, becomes an edge to the file it names: `from a.b import c` goes to
a/b/c.py (or a/b/c/__init__.py) when c is a submodule, else to a/b's own file; a package's __init__.py is a
file like any other. Imports of anything outside the two trees (torch, the compiled mtp_core._C) are left out.

Two rules hold on that graph:
  - no cycle: no two files import each other, directly or through others (strongly connected components of
    more than one file), so each file can be read, tested and moved after the files it needs;
  - the layers: every import between two top-level units of mtp_core (a package such as `model/`, or a single
    module such as `sampling.py`; mtp_core/__init__.py is the unit `mtp_core`, all of cli/ is `cli`) goes down
    LAYERS, the declared order, bottom first. A new top-level package or module must be placed in it.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREES = ("mtp_core", "cli")

# Bottom to top: a unit may import only units listed before it (docs/architecture.md, "The packages").
LAYERS = [
    "config",            # the configuration schema: imports nothing of ours
    "chat_format",
    "tokenizer",
    "tokenizer_build",
    "yaml_config",
    "sampling",
    "kv_cache",          # block manager, prefix cache, latent cache tensors
    "kernels",           # pure ops and their torch references (the native decode reference writes the cache)
    "loader",            # checkpoint reading, quantized formats and linears; the model comes from its caller
    "quantize",          # `mtp quantize`: the loader's formats
    "model",             # the torch modules
    "tiny",
    "scale_model",
    "native",            # the native CPU forward of a model: typed weights, the decoder, native-or-torch
    "request",           # one request's state (Sequence, MTPState, SpecStats), below the engine and the drafter
    "speculative",
    "structured",        # grammars, and the guided acceptance rule (speculative/verifier.py's strict prefix)
    "engine",
    "llm",
    "distributed",
    "mtp_core",          # the package's facade (mtp_core/__init__.py)
    "bench",
    "train_mtp",
    "serve",
    "cli",
]

# Imports that still run up, (importer's unit, imported unit) -> why; each one is a debt, not a design.
KNOWN: dict[tuple[str, str], str] = {}


def _file_of(root: Path, module: str) -> Path | None:
    """The file that module `a.b.c` is, under root: a/b/c.py or a/b/c/__init__.py; None outside our trees."""
    parts = module.split(".")
    if parts[0] not in TREES:
        return None
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _package_of(root: Path, path: Path) -> list[str]:
    """The dotted package a file belongs to (a package's __init__.py belongs to that package itself)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]


def imports_of(root: Path, path: Path) -> set[Path]:
    """The files under root that `path` imports, at any depth of its syntax tree."""
    out: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
            # `import a.b.c` binds a, runs a and a.b too; the file it is about is a/b/c
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(root, path)
                pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from a.b import c`: the submodule a/b/c when there is one, else a.b's own file
            targets = [f"{base}.{alias.name}" if _file_of(root, f"{base}.{alias.name}") else base
                       for alias in node.names]
        else:
            continue
        out |= {f for f in (_file_of(root, t) for t in targets) if f is not None and f != path}
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """{file: files it imports}, paths relative to root, for every .py under root's TREES."""
    files = sorted(p for tree in TREES for p in (root / tree).rglob("*.py"))
    rel = lambda p: p.relative_to(root).as_posix()   # noqa: E731
    return {rel(f): {rel(g) for g in imports_of(root, f)} for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def unit_of(file: str) -> str:
    """The top-level unit a file belongs to: mtp_core/model/mla.py -> model, mtp_core/llm.py -> llm,
    mtp_core/__init__.py -> mtp_core, cli/... -> cli."""
    parts = file.removesuffix(".py").split("/")
    if parts[0] != "mtp_core":
        return parts[0]
    return "mtp_core" if parts[1:] == ["__init__"] else parts[1]


def upward_imports(graph: dict[str, set[str]], layers: list[str],
                   known: dict[tuple[str, str], str]) -> list[str]:
    """'a.py -> b.py (unit -> unit)' for every import between units that does not go down `layers`, known ones
    excepted; a unit missing from layers is reported too."""
    rank = {u: i for i, u in enumerate(layers)}
    bad = []
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            a, b = unit_of(src), unit_of(dst)
            if a == b or (a, b) in known:
                continue
            if a not in rank or b not in rank:
                bad.append(f"{src} -> {dst}: unit {a if a not in rank else b!r} is not in LAYERS")
            elif rank[b] > rank[a]:
                bad.append(f"{src} -> {dst} ({a} imports {b}, which is above it)")
    return bad


# ---- the rules on this repository -------------------------------------------------------------------
def test_the_graph_sees_the_tree() -> None:
    graph = import_graph(REPO)
    assert len(graph) > 120
    assert "mtp_core/model/deepseek_v3.py" in graph["mtp_core/model/__init__.py"]
    assert "mtp_core/config/engine.py" in graph["mtp_core/config/__init__.py"]          # relative import
    assert "mtp_core/kernels/__init__.py" in graph["mtp_core/model/mla.py"]             # from mtp_core import kernels
    assert sum(len(v) for v in graph.values()) > 350


def test_no_import_cycles() -> None:
    found = cycles(import_graph(REPO))
    assert not found, "import cycles (files that import each other, directly or not):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_nothing_imports_up() -> None:
    bad = upward_imports(import_graph(REPO), LAYERS, KNOWN)
    assert not bad, "imports that run up LAYERS:\n" + "\n".join("  " + b for b in bad)


def test_every_unit_is_placed_and_known_debts_are_still_real() -> None:
    graph = import_graph(REPO)
    units = {unit_of(f) for f in graph}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))
    assert len(LAYERS) == len(set(LAYERS))
    edges = {(unit_of(a), unit_of(b)) for a, bs in graph.items() for b in bs}
    stale = sorted(k for k in KNOWN if k not in edges)
    assert not stale, f"KNOWN lists imports that no longer exist (remove them): {stale}"


# ---- the checks themselves catch what they are for ----------------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path) -> None:
    root = _tree(tmp_path, {
        "mtp_core/__init__.py": "",
        "mtp_core/kernels/__init__.py": "from mtp_core.kernels.ops import op\n",
        "mtp_core/kernels/ops.py": "def op():\n    from mtp_core.model.dsa import score\n",
        "mtp_core/model/__init__.py": "",
        "mtp_core/model/dsa.py": "from mtp_core import kernels\nfrom . import rope\n",
        "mtp_core/model/rope.py": "from .dsa import x\n",
        "cli/__init__.py": "import mtp_core\n",
    })
    graph = import_graph(root)
    assert graph["mtp_core/model/dsa.py"] == {"mtp_core/kernels/__init__.py", "mtp_core/model/rope.py"}
    assert cycles(graph) == [["mtp_core/kernels/__init__.py", "mtp_core/kernels/ops.py", "mtp_core/model/dsa.py",
                              "mtp_core/model/rope.py"]]
    assert upward_imports(graph, ["kernels", "model", "mtp_core", "cli"], {}) == [
        "mtp_core/kernels/ops.py -> mtp_core/model/dsa.py (kernels imports model, which is above it)"]
    assert upward_imports(graph, ["kernels", "model", "mtp_core", "cli"], {("kernels", "model"): "debt"}) == []
    missing = upward_imports(graph, ["kernels", "model", "cli"], {})
    assert "cli/__init__.py -> mtp_core/__init__.py: unit 'mtp_core' is not in LAYERS" in missing


def test_relative_imports_resolve_from_their_package(tmp_path) -> None:
    root = _tree(tmp_path, {
        "mtp_core/__init__.py": "from .config import X\nfrom . import llm\n",
        "mtp_core/llm.py": "",
        "mtp_core/config/__init__.py": "from .engine import X\n",
        "mtp_core/config/engine.py": "from ..llm import y\nfrom .. import sampling\n",
        "mtp_core/sampling.py": "import torch\nimport mtp_core._C as _C\n",
    })
    graph = import_graph(root)
    assert graph["mtp_core/__init__.py"] == {"mtp_core/config/__init__.py", "mtp_core/llm.py"}
    assert graph["mtp_core/config/engine.py"] == {"mtp_core/llm.py", "mtp_core/sampling.py"}
    assert graph["mtp_core/sampling.py"] == set()
    assert cycles(graph) == []
