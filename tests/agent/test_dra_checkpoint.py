"""The DRA checkpoint: a round trip, unreadable files moved aside (never blocking), the size bound, and a
hypothesis fuzz of claim ids and allocation contents that never raises out of the servicer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.agent.dra.api import dra_v1_pb2
from gputopo.agent.dra.cdi import CdiWriter
from gputopo.agent.dra.checkpoint import (
    MAX_CHECKPOINT_BYTES,
    Checkpoint,
    CheckpointError,
    PreparedClaim,
    PreparedDevice,
    atomic_write,
    decode,
    encode,
)
from gputopo.agent.dra.driver import DraDriver
from gputopo.agent.dra.service import DraPluginServicer
from gputopo.engine.dra.devices import DRIVER
from tests.agent.dp_harness import NODE, topology
from tests.agent.dra_harness import FakeClaims


def _claim(uid: str = "u1") -> PreparedClaim:
    return PreparedClaim(uid, "ns", "c", (PreparedDevice(("r",), NODE, "gpu-0", ("gputopo.io/gpu=GPU-1",)),))


def test_claims_survive_a_new_checkpoint_object(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    cp = Checkpoint(path)
    cp.add(_claim("u1"))
    cp.add(_claim("u2"))
    cp.remove("u1")
    cp.remove("never")
    assert dict(Checkpoint(path).claims()) == {"u2": _claim("u2")}
    assert json.loads(path.read_text())["version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]  # no temporary file left


@pytest.mark.parametrize(
    ("content", "error_part"),
    [
        pytest.param(b"{not json", "not JSON", id="not-json"),
        pytest.param(b"[]", "not a JSON object", id="not-an-object"),
        pytest.param(b'{"version": 2, "claims": {}}', "version 2", id="newer-version"),
        pytest.param(b'{"version": 1, "claims": []}', "claims is not an object", id="claims-list"),
        pytest.param(b'{"version": 1, "claims": {"u": {"namespace": 1}}}', "devices is not a list", id="bad-claim"),
        pytest.param(b" " * (MAX_CHECKPOINT_BYTES + 1), "over the", id="too-large"),
    ],
)
def test_an_unreadable_checkpoint_names_why_and_is_moved_aside(tmp_path: Path, content: bytes, error_part: str) -> None:
    with pytest.raises(CheckpointError, match=error_part):
        decode(content)
    path = tmp_path / "checkpoint.json"
    path.write_bytes(content)
    assert dict(Checkpoint(path).claims()) == {}
    assert not path.exists() and (tmp_path / "checkpoint.json.unreadable").read_bytes() == content


def test_a_checkpoint_over_the_bound_is_refused_and_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = Checkpoint(tmp_path / "checkpoint.json")
    cp.add(_claim("u1"))
    monkeypatch.setattr("gputopo.agent.dra.checkpoint.MAX_CHECKPOINT_BYTES", len(encode([_claim("u1")])) + 10)
    with pytest.raises(CheckpointError, match="over"):
        cp.add(_claim("u2"))
    assert list(Checkpoint(tmp_path / "checkpoint.json").claims()) == ["u1"]


def test_atomic_write_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.json"
    atomic_write(path, b"first, longer content")
    atomic_write(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


# ---------------------------------------------------------------------------------------------- fuzz

_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_result = st.fixed_dictionaries(
    {},
    optional={
        "driver": st.sampled_from([DRIVER, "other.example.com"]) | _json,
        "pool": st.sampled_from([NODE, "other-node"]) | _json,
        "device": st.sampled_from(["gpu-0", "gpu-7", "gpu-8", "gpu-", "gpu-00", "nic-0"]) | _json,
        "request": st.sampled_from(["r", "r/sub"]) | _json,
    },
)
_claim_doc = st.fixed_dictionaries(
    {
        "metadata": st.fixed_dictionaries({}, optional={"uid": st.sampled_from(["u", "x"]) | _json}) | _json,
        "status": st.fixed_dictionaries(
            {},
            optional={
                "allocation": st.fixed_dictionaries(
                    {},
                    optional={
                        "devices": st.fixed_dictionaries(
                            {}, optional={"results": st.lists(_result, max_size=5) | _json}
                        )
                    },
                )
                | _json
            },
        )
        | _json,
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    refs=st.lists(st.tuples(st.sampled_from(["u", "x", ""]) | _text, _text, _text), max_size=4),
    doc=_claim_doc,
)
def test_prepare_never_raises_and_answers_every_claim(
    tmp_path_factory: pytest.TempPathFactory, refs: list[tuple[str, str, str]], doc: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    claims = FakeClaims()
    for _, ns, name in refs:
        claims.claims[(ns, name)] = doc
    driver = DraDriver(NODE, claims, Checkpoint(tmp / "cp.json"), CdiWriter(tmp / "cdi", tmp), topology())
    servicer = DraPluginServicer(driver, dra_v1_pb2)
    request = dra_v1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(uid=u, namespace=ns, name=n) for u, ns, n in refs]
    )
    resp = servicer.NodePrepareResources(request, None)
    assert set(resp.claims) == {u for u, _, _ in refs}
    for uid, r in resp.claims.items():
        assert bool(r.error) != bool(r.devices) or (not r.error and not r.devices)
        for d in r.devices:
            assert d.pool_name == NODE and d.device_name in {f"gpu-{i}" for i in range(8)}
        if not r.error:
            assert uid in driver.prepared()
    un = DraPluginServicer(driver, dra_v1_pb2).NodeUnprepareResources(
        dra_v1_pb2.NodeUnprepareResourcesRequest(claims=request.claims), None
    )
    assert all(not r.error for r in un.claims.values())
    assert dict(driver.prepared()) == {}
