"""Compile `nvmlmock.c` into `libnvidia-ml.so.1` with the system C compiler, once per source version.

The library lands in `<cache>/nvmlmock/<key>/libnvidia-ml.so.1` (cache: $GPUTOPO_CACHE, else
$XDG_CACHE_HOME/gputopo, else ~/.cache/gputopo), the key a hash of the source, the compiler command and
the functions left out, so a changed source rebuilds and a finished build is reused. It is compiled
beside its final place and renamed there, so concurrent builders never see half a library.
`omit` leaves functions out of the library's symbol table: nvidia-ml-py then raises FunctionNotFound
from its own missing-symbol path, as with an older driver.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Collection
from pathlib import Path

SOURCE = Path(__file__).with_name("nvmlmock.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
# The variable the library reads its profile path from.
PROFILE_ENV = "GPUTOPO_NVML_PROFILE"
_FLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-pthread")
_EXPORT = re.compile(r"^EXPORT [^(]*?\b(nvml\w+)\(", re.MULTILINE)


class LibraryBuildError(RuntimeError):
    """The library could not be built (no C compiler, a compile error, an unknown function to omit)."""


def exported_functions() -> tuple[str, ...]:
    """Every NVML function the source exports, in source order."""
    return tuple(_EXPORT.findall(SOURCE.read_text(encoding="utf-8")))


def _cache_root() -> Path:
    if root := os.environ.get("GPUTOPO_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gputopo"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise LibraryBuildError("no C compiler found (set CC, or install cc/gcc) to build the NVML mock library")
    return cc


def build_library(cache: Path | None = None, omit: Collection[str] = ()) -> Path:
    """The directory holding the built `libnvidia-ml.so.1` (built now unless already there)."""
    exported = exported_functions()
    unknown = sorted(set(omit) - set(exported))
    if unknown:
        raise LibraryBuildError(f"cannot omit {unknown}: the NVML mock library does not export them")
    cc = _compiler()
    keep = [f for f in exported if f not in omit]
    script = "{ global: " + " ".join(f"{f};" for f in keep) + " local: *; };\n"
    key = hashlib.sha256("\0".join([SOURCE.read_text(encoding="utf-8"), cc, *_FLAGS, script]).encode()).hexdigest()
    out_dir = (cache or _cache_root()) / "nvmlmock" / key[:16]
    lib = out_dir / LIBRARY_NAME
    if lib.is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        version_script = Path(tmp) / "exports.map"
        version_script.write_text(script, encoding="utf-8")
        built = Path(tmp) / LIBRARY_NAME
        cmd = [cc, *_FLAGS, f"-Wl,-soname,{LIBRARY_NAME}", f"-Wl,--version-script={version_script}"]
        cmd += ["-o", str(built), str(SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LibraryBuildError(f"{cc} could not build {SOURCE.name}: {e}") from None
        if proc.returncode != 0:
            raise LibraryBuildError(f"{cc} failed on {SOURCE.name} ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(built, lib)
    return out_dir
