"""Product code keeps its shape: modules of at most 450 lines, functions of at most 80.

Long modules and functions hide more than one job; this names each one over, so it is split by job
rather than grown. Generated protobuf modules (`*_pb2*.py`) are not written here and are skipped.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
