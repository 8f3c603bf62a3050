"""Compile `nvmlmock.c` into `libnvidia-ml.so.1` with the system C compiler, once per source version.

The library lands in `<cache>/nvmlmock/<key>/libnvidia-ml.so.1` (cache: $GPUTOPO_CACHE, else
$XDG_CACHE_HOME/gputopo, else ~/.cache/gputopo), the key a hash of the source, the compiler command and
the functions left out, so a changed source rebuilds and a finished build is reused. It is compiled
beside its final place and renamed there, so concurrent builders never see half a library. The agent
loads what it finds there, so the cache is trusted only where nobody else can write: the folders from
`<cache>/nvmlmock` down and the library itself must be the user's own, not writable by group or others,
and the library a plain file (not a link); the cache root may be shared only with the sticky bit.
`omit` leaves functions out of the library's symbol table: nvidia-ml-py then raises FunctionNotFound
from its own missing-symbol path, as with an older driver.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
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


def _refuse_unless_private(path: Path, *, sticky_ok: bool = False) -> None:
    """LibraryBuildError unless `path` is a folder or plain file (never a link) that only this user can
    write: another user's file there would be loaded as libnvidia-ml into the agent."""
    try:
        st = path.lstat()
    except OSError as e:
        raise LibraryBuildError(f"cannot check the NVML mock cache {path}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise LibraryBuildError(f"NVML mock cache {path} is not a plain folder or file; remove it")
    if sticky_ok and st.st_mode & stat.S_ISVTX:
        return  # a shared root such as /tmp: others cannot rename or replace what this user made there
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LibraryBuildError(
            f"NVML mock cache {path} can be written by another user (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): refusing to load a library from it; use a private GPUTOPO_CACHE"
        )


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
    root = cache or _cache_root()
    out_dir = root / "nvmlmock" / key[:16]
    lib = out_dir / LIBRARY_NAME
    root.mkdir(parents=True, exist_ok=True)
    _refuse_unless_private(root, sticky_ok=True)
    for folder in (out_dir.parent, out_dir):
        folder.mkdir(mode=0o700, exist_ok=True)
        _refuse_unless_private(folder)
    if lib.exists() or lib.is_symlink():
        _refuse_unless_private(lib)
        return out_dir
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
