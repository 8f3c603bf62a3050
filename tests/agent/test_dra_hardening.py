"""The DRA driver against an attacker on the node (the security issue's L1-L5, L9): over the real unix
sockets where the finding is about the wire, waiting for outcomes (a read blocked on an Event), never
for durations; hypothesis for claim uids, device names and checkpoint bytes."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gputopo.agent.dra import cdi as cdi_module
from gputopo.agent.dra import checkpoint as checkpoint_module
from gputopo.agent.dra.api import dra_v1_pb2, pluginregistration_pb2
from gputopo.agent.dra.cdi import CdiWriter, claim_spec_path, node_spec_path
from gputopo.agent.dra.checkpoint import CHECKPOINT_NAME, Checkpoint, PreparedClaim, PreparedDevice, encode
from gputopo.agent.dra.driver import MAX_API_READS, DraDriver
from gputopo.agent.dra.service import DraPluginServicer
from gputopo.engine.dra.devices import DRIVER
from gputopo.model.dra import device_index, template_gpus
from tests.agent.dp_harness import NODE, topology, wait_for
from tests.agent.dra_harness import FakeClaims, Running, claim_object, running_dra


def _claim(uid: str) -> Any:
    return dra_v1_pb2.Claim(uid=uid, namespace="default", name=f"claim-{uid}")


def _prepare(h: Running, *uids: str) -> Any:
    req = dra_v1_pb2.NodePrepareResourcesRequest(claims=[_claim(u) for u in uids])
    return h.v1.NodePrepareResources(req, timeout=30)


def _unprepare(h: Running, *uids: str) -> Any:
    req = dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[_claim(u) for u in uids])
    return h.v1.NodeUnprepareResources(req, timeout=30)


def _checkpoint_path(h: Running) -> Path:
    return h.config.plugins_dir / DRIVER / CHECKPOINT_NAME


def _on_disk(h: Running) -> set[str]:
    """The claims a restarted agent would find prepared."""
    return set(Checkpoint(_checkpoint_path(h)).claims())


class BlockingClaims(FakeClaims):
    """FakeClaims whose reads wait for `release`; `waiting` counts the reads held now."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = 0
        self._mu = threading.Lock()

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        with self._mu:
            self.waiting += 1
        try:
            self.release.wait()
        finally:
            with self._mu:
                self.waiting -= 1
        return super().get_resource_claim(namespace, name)


@contextmanager
def _calls() -> Iterator[futures.ThreadPoolExecutor]:
    pool = futures.ThreadPoolExecutor(16)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------------- L1


def test_an_unprepare_racing_a_prepare_wins(tmp_path: Path) -> None:
    claims = BlockingClaims()
    claims.add(claim_object("u1", ["gpu-0"]))
    with running_dra(tmp_path, topology(), claims) as h, _calls() as pool:
        try:
            prepare = pool.submit(_prepare, h, "u1")
            wait_for(lambda: claims.waiting == 1, what="the prepare reading the claim")
            assert _unprepare(h, "u1").claims["u1"].error == ""
        finally:
            claims.release.set()
        got = prepare.result().claims["u1"]
        assert "unprepared while this Prepare read it" in got.error and not got.devices
        assert "u1" not in h.plugin.driver.prepared()  # type: ignore[union-attr]
        assert _on_disk(h) == set()
        assert not claim_spec_path(h.config.cdi_dir, "u1").exists()
        assert _prepare(h, "u1").claims["u1"].error == ""  # a later Prepare is a new one


# ------------------------------------------------------------------------------------------- L2


def _results(*devices: tuple[str, str, str]) -> list[dict[str, str]]:
    return [{"request": "gpus", "driver": d, "pool": p, "device": n} for d, p, n in devices]


@pytest.mark.parametrize(
    ("results", "error_part"),
    [
        pytest.param(
            _results((DRIVER, "other-node", "gpu-0"), (DRIVER, "other-node", "gpu-1")),
            "devices of pool 'other-node', not this node's (gpu-node-1)",
            id="another-nodes-pool",
        ),
        pytest.param(
            _results(("gpu.nvidia.com", NODE, "gpu-0")), "no device of driver gpu.gputopo.io", id="another-driver"
        ),
        pytest.param(
            _results((DRIVER, NODE, "gpu-0"), (DRIVER, "other-node", "gpu-1")),
            "devices of pool 'other-node'",
            id="split-over-two-nodes",
        ),
        pytest.param([], "no device of driver gpu.gputopo.io", id="nothing-allocated"),
    ],
)
def test_a_claim_not_for_this_node_or_driver_gets_its_own_error(
    tmp_path: Path, results: list[dict[str, str]], error_part: str
) -> None:
    claims = FakeClaims()
    bad = claims.add(claim_object("bad"))
    bad["status"]["allocation"]["devices"]["results"] = results
    claims.add(claim_object("good", ["gpu-3"]))
    with running_dra(tmp_path, topology(), claims) as h:
        resp = _prepare(h, "bad", "good")
        assert error_part in resp.claims["bad"].error and not resp.claims["bad"].devices
        assert resp.claims["good"].error == ""
        assert _on_disk(h) == {"good"}
        assert not claim_spec_path(h.config.cdi_dir, "bad").exists()


# ------------------------------------------------------------------------------------------- L3


def test_an_unprepare_completes_while_prepares_are_blocked_on_the_api(tmp_path: Path) -> None:
    claims = BlockingClaims()
    uids = [f"p{i}" for i in range(6)]
    for u in uids:
        claims.add(claim_object(u))
    with running_dra(tmp_path, topology(), claims) as h, _calls() as pool:
        try:
            prepares = [pool.submit(_prepare, h, u) for u in uids]
            wait_for(lambda: claims.waiting == 6, what="six prepares reading the API")
            assert _unprepare(h, "other").claims["other"].error == ""
            assert not claims.release.is_set()  # answered while all six still wait on the API
        finally:
            claims.release.set()
        assert all(f.result().claims[u].error == "" for f, u in zip(prepares, uids, strict=True))


def test_a_prepare_past_the_api_read_cap_fails_at_once_naming_it(tmp_path: Path) -> None:
    claims = BlockingClaims()
    uids = [f"p{i}" for i in range(MAX_API_READS + 1)]
    for u in uids:
        claims.add(claim_object(u))
    with running_dra(tmp_path, topology(), claims) as h, _calls() as pool:
        try:
            held = [pool.submit(_prepare, h, u) for u in uids[:-1]]
            wait_for(lambda: claims.waiting == MAX_API_READS, what="the API reads at the cap")
            late = _prepare(h, uids[-1]).claims[uids[-1]]
            assert not claims.release.is_set()
        finally:
            claims.release.set()
        assert f"{MAX_API_READS} claims are being read from the API server already" in late.error
        assert all(f.result().claims[u].error == "" for f, u in zip(held, uids[:-1], strict=True))
        assert _prepare(h, uids[-1]).claims[uids[-1]].error == ""  # the kubelet's retry


# ------------------------------------------------------------------------------------------- L4


def _directory(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "inside").write_text("x")


def _deep_json(path: Path) -> None:
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink(path: Path) -> None:
    target = path.parent / "elsewhere.json"
    target.write_bytes(encode([]))
    path.symlink_to(target)


def _directory_over_an_earlier_file(path: Path) -> None:
    path.with_name(CHECKPOINT_NAME + ".unreadable").write_text("an earlier one")
    _directory(path)


def _junk_over_an_earlier_directory(path: Path) -> None:
    _directory(path.with_name(CHECKPOINT_NAME + ".unreadable"))
    path.write_bytes(b"\x00junk")


@pytest.mark.timeout(60)  # today's FIFO case hangs in open()
@pytest.mark.parametrize(
    "make",
    [_directory, _deep_json, _fifo, _symlink, _directory_over_an_earlier_file, _junk_over_an_earlier_directory],
    ids=["directory", "deep-json", "fifo", "symlink", "directory-over-earlier-file", "junk-over-earlier-directory"],
)
def test_anything_but_a_checkpoint_file_is_moved_aside_and_the_driver_starts(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    path = tmp_path / "plugins" / DRIVER / CHECKPOINT_NAME
    path.parent.mkdir(parents=True)
    make(path)
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    with running_dra(tmp_path, topology(), claims) as h:
        info = h.registration.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=10)
        assert info.name == DRIVER
        assert os.path.lexists(path.with_name(CHECKPOINT_NAME + ".unreadable"))
        assert _prepare(h, "u1").claims["u1"].error == ""
        assert path.is_file() and not path.is_symlink() and _on_disk(h) == {"u1"}


_nested = st.integers(1, 200_000).map(lambda d: b"[" * d + b"]" * d) | st.integers(1, 200_000).map(
    lambda d: b'{"version": 1, "claims": ' * d
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048) | _nested | st.builds(lambda c: encode(c), st.just([])))
def test_any_checkpoint_bytes_load_or_are_moved_aside(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("cp") / CHECKPOINT_NAME
    path.write_bytes(data)
    claims = Checkpoint(path).claims()
    aside = path.with_name(CHECKPOINT_NAME + ".unreadable")
    if aside.exists():
        assert aside.read_bytes() == data and not path.exists() and not claims
    else:
        assert path.read_bytes() == data


# ------------------------------------------------------------------------------------------- L5


def _failing(real: Callable[..., None], when: Callable[[Path], bool]) -> Callable[..., None]:
    def write(path: Path, data: bytes, mode: int = 0o644) -> None:
        if when(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data, mode)

    return write


def test_a_failed_checkpoint_write_removes_the_claims_cdi_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        checkpoint_module, "atomic_write", _failing(checkpoint_module.atomic_write, lambda p: p.name == CHECKPOINT_NAME)
    )
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    with running_dra(tmp_path, topology(), claims) as h:
        got = _prepare(h, "u1").claims["u1"]
        assert not claim_spec_path(h.config.cdi_dir, "u1").exists()
        assert "cannot record it: OSError" in got.error and "No space left" in got.error
        assert "u1" not in h.plugin.driver.prepared()  # type: ignore[union-attr]


def test_a_failed_checkpoint_write_at_unprepare_leaves_the_claim_prepared_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    with running_dra(tmp_path, topology(), claims) as h:
        assert _prepare(h, "u1").claims["u1"].error == ""
        real = checkpoint_module.atomic_write
        monkeypatch.setattr(checkpoint_module, "atomic_write", _failing(real, lambda p: p.name == CHECKPOINT_NAME))
        assert "No space left" in _unprepare(h, "u1").claims["u1"].error
        assert claim_spec_path(h.config.cdi_dir, "u1").exists() and _on_disk(h) == {"u1"}
        monkeypatch.setattr(checkpoint_module, "atomic_write", real)
        assert _unprepare(h, "u1").claims["u1"].error == ""  # the kubelet's retry
        assert not claim_spec_path(h.config.cdi_dir, "u1").exists() and _on_disk(h) == set()


def test_a_full_cdi_directory_at_start_starts_and_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = [True]
    monkeypatch.setattr(cdi_module, "atomic_write", _failing(checkpoint_module.atomic_write, lambda _p: full[0]))
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    with running_dra(tmp_path, topology(), claims) as h:
        assert not node_spec_path(h.config.cdi_dir).exists()
        got = _prepare(h, "u1").claims["u1"]
        assert "the CDI spec of the node's GPUs cannot be written: OSError" in got.error
        assert _unprepare(h, "u1").claims["u1"].error == ""  # served meanwhile
        full[0] = False
        h.plugin.update(topology())  # the next discovery cycle writes it
        assert node_spec_path(h.config.cdi_dir).exists()
        assert _prepare(h, "u1").claims["u1"].error == ""


def test_a_full_cdi_directory_is_retried_by_the_next_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = [True]
    monkeypatch.setattr(cdi_module, "atomic_write", _failing(checkpoint_module.atomic_write, lambda _p: full[0]))
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    with running_dra(tmp_path, topology(), claims) as h:
        full[0] = False
        assert _prepare(h, "u1").claims["u1"].error == ""
        assert node_spec_path(h.config.cdi_dir).exists()


def test_claim_specs_the_checkpoint_does_not_hold_are_removed_at_start(tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    writer = CdiWriter(cdi_dir, tmp_path)
    for uid in ("kept", "orphan"):
        writer.write_claim(uid, ["GPU-x"])
    (cdi_dir / ".gputopo.io-claim_orphan.json.abc.tmp").write_text("half")
    (cdi_dir / "other-vendor.json").write_text("{}")
    cp = Checkpoint(tmp_path / "plugins" / DRIVER / CHECKPOINT_NAME)
    cp.add(PreparedClaim("kept", "default", "claim-kept", (PreparedDevice(("gpus",), NODE, "gpu-0", ()),)))
    with running_dra(tmp_path, topology()):
        names = sorted(p.name for p in cdi_dir.iterdir())
    assert names == ["gputopo.io-claim_kept.json", "gputopo.io-gpu.json", "other-vendor.json"]


# ------------------------------------------------------------------------------------------- L9


@pytest.mark.parametrize(
    ("uid", "namespace", "name"),
    [
        pytest.param("x\n", "default", "claim-x", id="uid-trailing-newline"),
        pytest.param("x", "default\n", "claim-x", id="namespace-trailing-newline"),
        pytest.param("x", "default", "claim-x\n", id="name-trailing-newline"),
        pytest.param("../x", "default", "claim-x", id="uid-path"),
        pytest.param("x", "Default", "claim-x", id="namespace-not-a-label"),
    ],
)
def test_a_claim_reference_with_a_trailing_newline_or_bad_characters_is_refused(
    tmp_path: Path, uid: str, namespace: str, name: str
) -> None:
    claims = FakeClaims()
    claims.add(claim_object(uid, namespace=namespace, name=name))
    with running_dra(tmp_path, topology(), claims) as h:
        req = dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(uid=uid, namespace=namespace, name=name)])
        got = h.v1.NodePrepareResources(req, timeout=30).claims[uid]
        assert repr(uid if uid != "x" else (namespace if namespace != "default" else name)) in got.error
        assert h.claims.reads == 0 and not got.devices
        assert sorted(p.name for p in h.config.cdi_dir.iterdir()) == ["gputopo.io-gpu.json"]


@pytest.mark.parametrize("name", ["gpu-\u0663", "gpu-\u00b2", "gpu-1\u0663", "gpu-\uff11", "gpu-1\n"])
def test_a_device_name_with_non_ascii_digits_is_not_ours(tmp_path: Path, name: str) -> None:
    assert device_index(name) is None
    claims = FakeClaims()
    claims.add(claim_object("u1", [name]))
    with running_dra(tmp_path, topology(), claims) as h:
        assert f"{name!r} of pool gpu-node-1 is not a GPU" in _prepare(h, "u1").claims["u1"].error


@pytest.mark.parametrize("name", ["gputopo-gpus-\u00b2-x", "gputopo-gpus-\u0663-x", "gputopo-gpus-\uff18"])
def test_a_template_name_with_non_ascii_digits_is_not_ours(name: str) -> None:
    assert template_gpus(name) is None


@given(st.text(max_size=12))
@example("\u0663")
@example("\u00b2")
def test_device_index_takes_only_canonical_ascii_names(rest: str) -> None:
    index = device_index(f"gpu-{rest}")
    canonical = rest.isascii() and rest.isdigit() and str(int(rest)) == rest and int(rest) < 4096
    assert (index is not None) == canonical
    assert index is None or f"gpu-{index}" == f"gpu-{rest}"


_uids = st.text(max_size=20) | st.sampled_from(["x\n", "x\r", "x\x00", "\u0663", "a" * 129, "ok-1", "a.b:c_d"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(uid=_uids)
def test_an_accepted_claim_uid_names_exactly_one_cdi_file_of_cdi_characters(
    tmp_path_factory: pytest.TempPathFactory, uid: str
) -> None:
    tmp = tmp_path_factory.mktemp("uid")
    claims = FakeClaims()
    claims.claims[("default", "claim-x")] = claim_object(uid, name="claim-x")
    driver = DraDriver(NODE, claims, Checkpoint(tmp / "cp.json"), CdiWriter(tmp / "cdi", tmp), topology())
    servicer = DraPluginServicer(driver, dra_v1_pb2)
    req = dra_v1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(uid=uid, namespace="default", name="claim-x")]
    )
    got = servicer.NodePrepareResources(req, None).claims[uid]
    names = sorted(p.name for p in (tmp / "cdi").iterdir())
    ok = all(c.isascii() and (c.isalnum() or c in "_.:-") for c in uid) and 0 < len(uid) <= 128 and uid[0].isalnum()
    if ok:
        assert got.error == "" and names == sorted([f"gputopo.io-claim_{uid}.json", "gputopo.io-gpu.json"])
    else:
        assert got.error and names == ["gputopo.io-gpu.json"], (uid, got.error)
    assert json.loads((tmp / "cdi" / "gputopo.io-gpu.json").read_text())["kind"] == "gputopo.io/gpu"
