"""The repository stands alone: docs and docstrings point only at files it contains."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.paths import REPO

ROOT = REPO
TEXT = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".tpl", ".json")
OUTSIDE = re.compile(r"design\.md|\.\./shared|(?<![\w/])reference/[a-z-]+\.md")
DOC_REF = re.compile(r"\bdocs/([a-z][a-z0-9-]*\.md)")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / p for p in out.splitlines() if p.endswith(TEXT) and (ROOT / p).is_file()]


def test_no_file_points_outside_the_repository() -> None:
    here = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in _tracked_text_files()
        if p.resolve() != here
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []


def test_every_docs_page_named_anywhere_exists() -> None:
    missing = sorted(
        {
            f"{p.relative_to(ROOT)} names docs/{name}"
            for p in _tracked_text_files()
            for name in DOC_REF.findall(p.read_text(errors="replace"))
            if not (ROOT / "docs" / name).is_file()
        }
    )
    assert missing == []
