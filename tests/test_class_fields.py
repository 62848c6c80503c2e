"""Classes stay small: none in the engine, speculative decoding or request state holds more than MAX_FIELDS
fields (issue 42).

Every .py file under mtp_core/engine, mtp_core/speculative and mtp_core/request is parsed (never imported). A
class's fields are the union of its annotated class-level names (a dataclass's or NamedTuple's fields;
`ClassVar` annotations are not fields) and the distinct attribute names its methods assign on their first
argument (`self.x = ...`, `self.x: T = ...`, `self.x += ...`, `self.a, self.b = ...`, in nested functions
too). A class that grows past the limit is split into named groups (small dataclasses), not added to ALLOWED.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("mtp_core/engine", "mtp_core/speculative", "mtp_core/request")
MAX_FIELDS = 12
# Classes still over MAX_FIELDS, "path:qualified name" -> why; each one is a debt, not a design
ALLOWED: dict[str, str] = {}


def _is_classvar(annotation: ast.expr) -> bool:
    node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    if isinstance(node, ast.Constant) and isinstance(node.value, str):      # a string annotation
        return node.value.split("[", 1)[0].rsplit(".", 1)[-1] == "ClassVar"
    return (isinstance(node, ast.Name) and node.id == "ClassVar") or \
        (isinstance(node, ast.Attribute) and node.attr == "ClassVar")


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions an assignment statement binds, tuples and lists unpacked."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        todo = [node.target]
    else:
        return []
    out = []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _self_attributes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Attribute names a method assigns on its first argument (nested functions included, nested classes not)."""
    args = fn.args.posonlyargs + fn.args.args
    if not args or any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return set()
    me = args[0].arg
    names: set[str] = set()
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef):
            continue
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                names.add(t.attr)
        todo.extend(ast.iter_child_nodes(node))
    return names


def class_fields(tree: ast.AST) -> list[tuple[str, int, set[str]]]:
    """(qualified name, line, field names) of every class in `tree`, nested ones too."""
    out: list[tuple[str, int, set[str]]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = prefix + child.name
                names: set[str] = set()
                for stmt in child.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                            and not _is_classvar(stmt.annotation):
                        names.add(stmt.target.id)
                    elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names |= _self_attributes(stmt)
                out.append((name, child.lineno, names))
                walk(child, name + ".")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, prefix + child.name + ".<locals>.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def test_fields_are_annotations_and_self_assignments() -> None:
    src = ("from typing import ClassVar\n"
           "class D:\n    a: int\n    b: int = 0\n    K: ClassVar[int] = 3\n    C = 4\n"
           "    def m(self):\n        self.a = 1\n        self.c, (self.d, *self.e) = 1, (2, 3)\n"
           "        self.f += 1\n        other.g = 1\n"
           "        def inner():\n            self.h: int = 2\n"
           "    @staticmethod\n    def s(x):\n        x.i = 1\n"
           "    @classmethod\n    def k(cls):\n        cls.j = 1\n"
           "    class Inner:\n        def __init__(this):\n            this.z = 1\n")
    got = {name: names for name, _, names in class_fields(ast.parse(src))}
    assert got == {"D": {"a", "b", "c", "d", "e", "f", "h", "j"}, "D.Inner": {"z"}}


def test_an_oversized_dataclass_is_counted() -> None:
    src = "@dataclass\nclass Big:\n" + "".join(f"    f{i}: int = 0\n" for i in range(MAX_FIELDS + 1))
    [(name, _, names)] = class_fields(ast.parse(src))
    assert name == "Big" and len(names) == MAX_FIELDS + 1


def test_no_class_has_more_than_the_limit() -> None:
    files = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))
    assert len(files) > 15
    too_big, seen = [], set()
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for name, line, names in class_fields(ast.parse(path.read_text(), str(path))):
            key = f"{rel}:{name}"
            if key in ALLOWED and len(names) > MAX_FIELDS:
                seen.add(key)
            elif len(names) > MAX_FIELDS:
                too_big.append(f"{rel}:{line} {name}: {len(names)} fields ({', '.join(sorted(names))})")
    assert not too_big, f"classes with more than {MAX_FIELDS} fields (group them into small dataclasses):\n" + \
        "\n".join(too_big)
    assert seen == set(ALLOWED), \
        f"ALLOWED names classes that no longer exist or are within the limit: {sorted(set(ALLOWED) - seen)}"
