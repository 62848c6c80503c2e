"""Functions stay short: none in cli/ or mtp_core/ is longer than MAX_LINES (issue 42).

A function's length runs from its `def` line to its last line, nested functions included in their parent's
count (a command's signature with its option declarations counts too). A function that grows past the limit is
split into named steps, not added to ALLOWED.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 60
# Functions allowed over MAX_LINES, by "path:qualified name": none (a long function is split into named steps)
ALLOWED: set[str] = set()


def function_lengths(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualified name, def line, length in lines) of every function and method in `tree`, nested ones too."""
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def test_lengths_count_def_to_last_line_with_nested_functions() -> None:
    src = ("def f(\n    a,\n):\n    def g():\n        return 1\n    return g\n\n\n"
           "class C:\n    async def m(self):\n        pass\n")
    assert function_lengths(ast.parse(src)) == [("f", 1, 6), ("f.g", 4, 2), ("C.m", 10, 2)]


def test_no_function_is_longer_than_the_limit() -> None:
    files = sorted([*(REPO / "cli").rglob("*.py"), *(REPO / "mtp_core").rglob("*.py")])
    assert len(files) > 50
    too_long, seen = [], set()
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for name, line, length in function_lengths(ast.parse(path.read_text(), str(path))):
            key = f"{rel}:{name}"
            if key in ALLOWED:
                seen.add(key)
            elif length > MAX_LINES:
                too_long.append(f"{rel}:{line} {name}: {length} lines")
    assert not too_long, f"functions longer than {MAX_LINES} lines (split them into named steps):\n" + \
        "\n".join(too_long)
    assert seen == ALLOWED, f"ALLOWED names functions that no longer exist: {sorted(ALLOWED - seen)}"
