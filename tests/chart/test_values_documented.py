"""Every value in values.yaml is documented by a comment that starts with its dotted name."""

from __future__ import annotations

import re

from tests.chart.helm import CHART

# Values whose content is a Kubernetes object passed through as is (documented by Kubernetes).
PASSTHROUGH = {"resources", "updateStrategy"}

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9]*):(?:\s|$)")


def _undocumented() -> list[str]:
    missing: list[str] = []
    stack: list[tuple[int, str]] = []
    comments: list[str] = []
    in_list_at: int | None = None
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            comments = []
            continue
        indent = len(line) - len(line.lstrip(" "))
        if in_list_at is not None and indent > in_list_at:
            comments = []
            continue  # inside a list value: its items are data, not values to document
        in_list_at = None
        m = KEY.match(line)
        if m is None:
            if stripped.startswith("- "):
                in_list_at = indent - 1
            comments = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if any(k in PASSTHROUGH for _, k in stack):
            comments = []
            continue
        path = ".".join([*(k for _, k in stack), m["key"]])
        first = next((c for c in comments if c), "")
        if not first.startswith(path + " "):
            missing.append(path)
        stack.append((indent, m["key"]))
        comments = []
    return missing


def test_every_value_has_a_comment_starting_with_its_name() -> None:
    assert _undocumented() == []


def test_value_names_are_camel_case() -> None:
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = KEY.match(line)
        if m:
            assert "_" not in m["key"] and m["key"][0].islower(), m["key"]
