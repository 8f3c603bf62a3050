"""Every NVML call gputopo makes is answered by the NVML mock library, with the binding's signature.

The calls are read from the code: the `NvmlLib` protocol (the adapter reaches NVML only through it)
and every `nvml*` attribute used anywhere in gputopo, which must be in the protocol. Each protocol
function is followed into nvidia-ml-py's source to the C symbols it looks up, and each symbol must be
exported by the built library with the number of arguments the binding passes it.

Where the Python fake (tests/agent/fake_pynvml.py) is still needed: states the library cannot express
or that are not NVML's to give — nvidia-ml-py releases that declare the fabric struct differently
(12.560's 100-byte struct, 12.570's `c_char` UUID), counting which calls were made (links enumerated by
state, never by capability), a remote-type error on one link, and exceptions that are not NVML errors
(an OSError from sysfs, a type error from a binding).
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import re
from pathlib import Path

import pytest

import gputopo
from gputopo.agent import nvml_lib
from gputopo.localcluster.nvmlmock import build_library, exported_functions
from gputopo.localcluster.nvmlmock.build import LIBRARY_NAME, SOURCE

PACKAGE = Path(gputopo.__file__).parent


def protocol_functions() -> list[str]:
    """The NVML functions (and struct constructors) the `NvmlLib` protocol declares."""
    tree = ast.parse(inspect.getsource(nvml_lib.NvmlLib))
    (cls,) = tree.body
    assert isinstance(cls, ast.ClassDef)
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith(("nvml", "c_nvml"))]


def nvml_names_used_in_gputopo() -> set[str]:
    """Every `x.nvml*` attribute in gputopo's code: a call to NVML, whatever object it goes through."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and re.match(r"^c?_?nvml[A-Z]", node.attr):
                names.add(node.attr)
    return names


def c_symbols(pynvml: object, function: str, seen: set[str] | None = None) -> dict[str, int]:
    """{C symbol: arguments passed} for one binding function, following its calls to other binding
    functions (nvmlInit → nvmlInitWithFlags, nvmlDeviceGetPciInfo → nvmlDeviceGetPciInfo_v3)."""
    seen = seen if seen is not None else set()
    if function in seen:
        return {}
    seen.add(function)
    fn = getattr(pynvml, function)
    tree = ast.parse(inspect.getsource(inspect.unwrap(fn)))
    out: dict[str, int] = {}
    pointers: dict[str, str] = {}  # local name -> symbol
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if isinstance(call.func, ast.Name) and call.func.id == "_nvmlGetFunctionPointer":
                arg = call.args[0]
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        pointers[target.id] = arg.value
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name in pointers:
                out[pointers[name]] = len(node.args)
            elif name.startswith("nvml") and hasattr(pynvml, name):
                out |= c_symbols(pynvml, name, seen)
    return out


def c_arity() -> dict[str, int]:
    """{exported function: parameter count} from the library's C source."""
    text = SOURCE.read_text(encoding="utf-8")
    out = {}
    for m in re.finditer(r"^EXPORT [^(]*?\b(nvml\w+)\(([^)]*)\)", text, re.MULTILINE):
        params = m.group(2).strip()
        out[m.group(1)] = 0 if params in ("", "void") else params.count(",") + 1
    return out


def test_every_nvml_name_gputopo_uses_is_in_the_protocol() -> None:
    used = nvml_names_used_in_gputopo() - {"nvmlLib"}
    assert used <= set(protocol_functions()), sorted(used - set(protocol_functions()))


@pytest.mark.parametrize("function", [f for f in protocol_functions() if f.startswith("nvml")])
def test_libnvml_exports_each_call_with_the_bindings_signature(function: str, real_pynvml: object) -> None:
    symbols = c_symbols(real_pynvml, function)
    assert symbols, f"{function}: no C symbol found in nvidia-ml-py's source"
    lib = ctypes.CDLL(str(build_library() / LIBRARY_NAME))
    arity = c_arity()
    for symbol, args in symbols.items():
        assert symbol in exported_functions(), f"{function} calls {symbol}, which the NVML mock library lacks"
        assert hasattr(lib, symbol), f"{symbol} is not in the built library's symbol table"
        assert arity[symbol] == args, (
            f"{symbol}: the binding passes {args} arguments, the library takes {arity[symbol]}"
        )


def test_libnvml_struct_layouts_match_the_binding(real_pynvml: object) -> None:
    # The sizes nvml.h gives: nvmlPciInfo_t 68 bytes (busIdLegacy[16], five unsigned, busId[32]),
    # nvmlMemory_t 24, nvmlGpuFabricInfo_v2_t 36 (its version word carries the size), nvmlEventData_t 32.
    assert ctypes.sizeof(real_pynvml.nvmlPciInfo_t) == 68  # type: ignore[attr-defined]
    assert ctypes.sizeof(real_pynvml.c_nvmlMemory_t) == 24  # type: ignore[attr-defined]
    assert real_pynvml.nvmlGpuFabricInfo_v2 & 0xFFFFFF == 36  # type: ignore[attr-defined]
    # nvmlEventData_t: device handle, eventType and eventData (unsigned long long), two unsigned ids.
    assert ctypes.sizeof(real_pynvml.c_nvmlEventData_t) == 32  # type: ignore[attr-defined]
    assert "nvmlErrorString" in exported_functions()  # the binding names unknown codes through it
