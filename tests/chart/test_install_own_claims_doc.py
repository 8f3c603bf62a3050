"""docs/install.md, "Your own claims": every template the section shows is read by the extender as the
section says (a whole block, N GPUs of one clique, or refused with the sentence it quotes), so is the
pre-made claim it shows, and each pod it shows is placed as `gputopo.io/gpu-clique4: 1` is."""

from __future__ import annotations

import re
from typing import Any

import yaml

from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.templateasks import claim_ask, template_ask
from gputopo.model.claimask import ClaimAsk
from gputopo.model.claimtemplate import read_claim_template
from tests.paths import REPO

SECTION = "### Your own claims"
EXPECTED = {"my-quad": ClaimAsk(4, True), "my-clique-of-4": ClaimAsk(4)}


def section() -> str:
    text = (REPO / "docs" / "install.md").read_text()
    start = text.index(SECTION)
    return text[start : text.index("\n## ", start)]


def examples() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", section(), re.S)
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if d]
    for d in docs:
        d["metadata"].setdefault("namespace", "default")
    return docs


def templates() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in examples() if d["kind"] == "ResourceClaimTemplate"}


def test_each_template_shown_is_read_as_the_section_says() -> None:
    shown = templates()
    assert set(shown) == {*EXPECTED, "two-quads"}
    for name, ask in EXPECTED.items():
        assert template_ask(read_claim_template(shown[name])) == ask, name
    refused = template_ask(read_claim_template(shown["two-quads"])).problem
    quoted = re.search(r"A pod naming `two-quads` is told `(.*?)`", " ".join(section().split()))
    assert quoted is not None
    head, _, tail = quoted.group(1).partition("(...)")
    assert refused.startswith(head) and refused.endswith(tail), refused


def test_the_pre_made_claim_shown_is_read_as_one_whole_block() -> None:
    (claim,) = [d for d in examples() if d["kind"] == "ResourceClaim"]
    assert claim_ask(claim) == (("default", "my-quad-claim"), ClaimAsk(4, True))


def test_each_pod_shown_asks_the_block_of_its_template_or_claim() -> None:
    cache = ClusterCache()
    cache.replace("resourceclaimtemplates", list(templates().values()))
    cache.replace("resourceclaims", [d for d in examples() if d["kind"] == "ResourceClaim"])
    pods = [d for d in examples() if d["kind"] == "Pod"]
    assert len(pods) == 2
    for i, pod in enumerate(pods):
        pod["metadata"]["uid"] = f"u{i}"
    cache.replace("pods", pods)
    for i in range(len(pods)):
        request = cache.ledger.pods[f"u{i}"].request
        assert request is not None and (request.gpus, request.block) == (4, True)
