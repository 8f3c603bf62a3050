"""Every value in values.yaml is documented by a comment that starts with its dotted name."""

from __future__ import annotations

import re

from tests.chart.helm import CHART, values_doc

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9]*):(?:\s|$)")


def _undocumented() -> list[str]:
    docs = values_doc().walk((CHART / "values.yaml").read_text())
    return [d.path for d in docs if not (d.comment and d.comment[0].startswith(d.path + " "))]


def test_every_value_has_a_comment_starting_with_its_name() -> None:
    assert _undocumented() == []


def test_value_names_are_camel_case() -> None:
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = KEY.match(line)
        if m:
            assert "_" not in m["key"] and m["key"][0].islower(), m["key"]
