"""Product code keeps its shape: modules of at most 450 lines, functions of at most 80 lines and of at
most 7 parameters.

Long modules and functions hide more than one job; this names each one over, so it is split by job
rather than grown. A long parameter list hides values that travel together: they become one small value
object named for what it is. Generated protobuf modules (`*_pb2*.py`) are not written here and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = REPO / "gputopo"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _product_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name)


def _oversized(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(PACKAGE.parent).as_posix()
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: module has {lines} lines (max {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(text, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1  # from `def` to the last line, nested functions included
            if length > MAX_FUNCTION_LINES:
                most = MAX_FUNCTION_LINES
                found.append(f"{name}:{node.lineno}: function {node.name} has {length} lines (max {most})")
    return found


def test_product_modules_and_functions_stay_short() -> None:
    modules = _product_modules()
    assert modules, f"no product modules found under {PACKAGE}"
    found = [line for path in modules for line in _oversized(path)]
    assert not found, "split these by job:\n" + "\n".join(found)


# Parameters a function takes, `self` and `cls` not counted, `*args` and `**kwargs` one each.
MAX_PARAMETERS = 7


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def _crowded(path: Path) -> list[str]:
    name = path.relative_to(PACKAGE.parent).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count = parameter_count(node)
            if count > MAX_PARAMETERS:
                found.append(f"{name}:{node.lineno}: {node.name} takes {count} parameters (max {MAX_PARAMETERS})")
    return found


def test_product_functions_take_few_parameters() -> None:
    found = [line for path in _product_modules() for line in _crowded(path)]
    assert not found, "group the parameters that travel together into a value object:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a, b): pass", 2),
        ("def f(self, a, *, b=1): pass", 2),
        ("def f(cls, /, a): pass", 1),
        ("def f(a, *args, **kwargs): pass", 3),
        ("async def f(a, *, b, c): pass", 3),
    ],
    ids=["plain", "self_is_not_counted", "cls_is_not_counted", "star_args_count_one_each", "async_keyword_only"],
)
def test_parameters_are_counted_as_the_limit_reads_them(source: str, expected: int) -> None:
    (node,) = ast.parse(source).body
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert parameter_count(node) == expected


# The extender and the engine are laid out a folder per concern (docs/architecture.md): a folder that
# grows past about a dozen modules holds more than one concern, and a package says what lives in it.
LAID_OUT = ("extender", "engine")
MAX_FOLDER_MODULES = 12


def _packages() -> list[Path]:
    return sorted(p.parent for top in LAID_OUT for p in (PACKAGE / top).rglob("__init__.py"))


def test_each_folder_holds_one_concern_and_says_what() -> None:
    found = []
    for folder in _packages():
        name = folder.relative_to(PACKAGE.parent).as_posix()
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_FOLDER_MODULES:
            found.append(f"{name}: {len(modules)} modules (max {MAX_FOLDER_MODULES})")
        if not ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))):
            found.append(f"{name}/__init__.py: no docstring saying what lives there and what it may import")
    assert not found, "\n".join(found)
