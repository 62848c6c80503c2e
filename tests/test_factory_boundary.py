"""The engine never imports the factory: no module under mtp_core/ names mtp_factory in an import (at top
level or inside a function), and importing every mtp_core module leaves mtp_factory out of sys.modules."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FACTORY = "mtp_factory"


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, nested ones included (`importlib.import_module("x")` too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in
              ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def test_scanner_sees_every_kind_of_import() -> None:
    src = ("import mtp_factory\nfrom mtp_factory.data import x\ndef f():\n    import mtp_factory.recipes as r\n"
           "    importlib.import_module('mtp_factory.trainer')\nfrom mtp_core import llm\n")
    assert [m for _, m in _imported_modules(ast.parse(src))] == [
        "mtp_factory", "mtp_factory.data", "mtp_core", "mtp_factory.recipes", "mtp_factory.trainer"]


def test_no_mtp_core_source_imports_the_factory() -> None:
    files = sorted((REPO / "mtp_core").rglob("*.py"))
    assert len(files) > 50
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}"
           for path in files for line, module in _imported_modules(ast.parse(path.read_text(encoding="utf-8")))
           if module == FACTORY or module.startswith(FACTORY + ".")]
    assert not bad, bad


_IMPORT_ALL = """
import importlib, pkgutil, sys
import mtp_core
names = [m.name for m in pkgutil.walk_packages(mtp_core.__path__, "mtp_core.")]
skipped = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:          # only a module that needs CUDA may fail here
        if "cuda" not in str(e).lower():
            raise
        skipped.append(name)
print(len(names), len(skipped), sorted(m for m in sys.modules if m == "mtp_factory" or m.startswith("mtp_factory.")))
"""


def test_importing_every_mtp_core_module_leaves_the_factory_unimported() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    total, skipped, factory = r.stdout.split(" ", 2)
    assert int(total) > 50 and int(skipped) < int(total)
    assert factory.strip() == "[]", factory
