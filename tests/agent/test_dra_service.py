"""The DRA driver over its real unix sockets: registration (GetInfo, NotifyRegistrationStatus), Prepare and
Unprepare on both API versions, the checkpoint across a restart, bad claims failing alone, sockets served again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from gputopo.agent.dra.api import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2
from gputopo.agent.dra.cdi import claim_spec_path, node_spec_path
from gputopo.engine.dra.devices import DRIVER
from gputopo.kube import KubeError
from gputopo.model import Health
from tests.agent.dp_harness import NODE, topology, wait_for, with_gpu
from tests.agent.dra_harness import FakeClaims, claim_object, running_dra

PB = {"v1": dra_v1_pb2, "v1beta1": dra_v1beta1_pb2}


def _claim(pb: Any, uid: str, name: str | None = None, namespace: str = "default") -> Any:
    return pb.Claim(uid=uid, namespace=namespace, name=name or f"claim-{uid}")


def _prepare(h: Any, version: str, *uids: str) -> Any:
    pb = PB[version]
    stub = h.v1 if version == "v1" else h.v1beta1
    return stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[_claim(pb, u) for u in uids]), timeout=10)


def test_get_info_names_the_driver_its_dra_socket_and_both_versions(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology()) as h:
        info = h.registration.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=10)
        assert h.plugin.server is not None
        assert (info.type, info.name) == ("DRAPlugin", DRIVER)
        assert info.endpoint == str(h.plugin.server.dra_socket.absolute())
        assert info.endpoint == str((tmp_path / "plugins" / DRIVER / "dra.sock").absolute())
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        assert h.plugin.server.registration_socket == tmp_path / "registry" / f"{DRIVER}-reg.sock"


def test_registration_status_is_recorded_and_a_success_rereads_the_slice(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology()) as h:
        assert h.plugin.server is not None
        reg = h.plugin.server.registration
        h.registration.NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="bad version"), timeout=10
        )
        assert (reg.registered, reg.last_error) == (False, "bad version")
        reads = h.slices.reads
        h.plugin.update(topology())  # confirmed recently: no read
        assert h.slices.reads == reads
        h.registration.NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(plugin_registered=True), timeout=10
        )
        assert reg.registered and reg.notifications == 2
        h.slices.slices.clear()  # a starting kubelet wipes its node's slices
        h.plugin.update(topology())
        assert h.slices.reads == reads + 1 and len(h.slices.slices) == 1


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_prepare_answers_cdi_names_and_writes_the_claims_visible_devices(tmp_path: Path, version: str) -> None:
    topo = topology()
    claims = FakeClaims()
    claims.add(claim_object("u1", [("tp", "gpu-2"), ("tp", "gpu-3")]))
    with running_dra(tmp_path, topo, claims) as h:
        resp = _prepare(h, version, "u1")
        got = resp.claims["u1"]
        assert got.error == ""
        assert [(list(d.request_names), d.pool_name, d.device_name) for d in got.devices] == [
            (["tp"], NODE, "gpu-2"),
            (["tp"], NODE, "gpu-3"),
        ]
        assert list(got.devices[0].cdi_device_ids) == [f"gputopo.io/gpu={topo.gpus[2].uuid}", "gputopo.io/claim=u1"]
        assert list(got.devices[1].cdi_device_ids) == [f"gputopo.io/gpu={topo.gpus[3].uuid}"]
        spec = json.loads(claim_spec_path(tmp_path / "cdi", "u1").read_text())
        assert spec["kind"] == "gputopo.io/claim"
        assert spec["devices"][0]["containerEdits"]["env"] == [
            f"NVIDIA_VISIBLE_DEVICES={topo.gpus[2].uuid},{topo.gpus[3].uuid}"
        ]
        node_spec = json.loads(node_spec_path(tmp_path / "cdi").read_text())
        assert [d["name"] for d in node_spec["devices"]] == [g.uuid for g in topo.gpus]


def test_prepare_takes_only_our_drivers_devices(tmp_path: Path) -> None:
    claims = FakeClaims()
    claim = claims.add(claim_object("u1", ["gpu-1"]))
    results = claim["status"]["allocation"]["devices"]["results"]
    results.append({"request": "nic", "driver": "nic.example.com", "pool": "other-node", "device": "eth0"})
    with running_dra(tmp_path, topology(), claims) as h:
        got = _prepare(h, "v1", "u1").claims["u1"]
    assert got.error == "" and [d.device_name for d in got.devices] == ["gpu-1"]


def test_a_prepared_claim_is_answered_from_the_checkpoint_after_a_restart(tmp_path: Path) -> None:
    claims = FakeClaims()
    claims.add(claim_object("u1", ["gpu-4", "gpu-5"]))
    with running_dra(tmp_path, topology(), claims) as h:
        first = _prepare(h, "v1", "u1").claims["u1"]
        again = _prepare(h, "v1", "u1").claims["u1"]
    assert claims.reads == 1 and again == first
    claims.claims.clear()  # the API server is no longer asked: a read would fail now
    with running_dra(tmp_path, topology(), claims) as h:  # a new agent: new servicer, same checkpoint
        after = _prepare(h, "v1beta1", "u1").claims["u1"]
        assert [d.device_name for d in after.devices] == ["gpu-4", "gpu-5"] and after.error == ""
        assert claims.reads == 1
        un = h.v1.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[_claim(dra_v1_pb2, "u1")]), timeout=10
        )
        assert un.claims["u1"].error == ""
        assert not claim_spec_path(tmp_path / "cdi", "u1").exists()
        assert "u1" not in h.plugin.driver.prepared()  # type: ignore[union-attr]
    with running_dra(tmp_path, topology(), claims) as h:
        assert h.plugin.driver is not None and dict(h.plugin.driver.prepared()) == {}


def test_unprepare_of_a_claim_never_prepared_succeeds(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology()) as h:
        un = h.v1.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[_claim(dra_v1_pb2, "nope")]), timeout=10
        )
    assert dict(un.claims) == {"nope": dra_v1_pb2.NodeUnprepareResourceResponse(error="")}


def _uid_changed(c: FakeClaims) -> None:
    c.add(claim_object("other-uid", name="claim-bad"))


def _not_allocated(c: FakeClaims) -> None:
    c.add(claim_object("bad", name="claim-bad", allocated=False))


@pytest.mark.parametrize(
    ("setup", "error_part"),
    [
        pytest.param(
            lambda c: c.add(claim_object("bad", ["gpu-9"])),
            "'gpu-9' of pool gpu-node-1 is not a GPU",
            id="unknown-device",
        ),
        pytest.param(lambda c: c.add(claim_object("bad", ["gpu-01"])), "'gpu-01'", id="non-canonical-device-name"),
        pytest.param(lambda c: c.add(claim_object("bad", ["gpu-6"])), "device gpu-6 (GPU 6", id="failed-gpu"),
        pytest.param(lambda c: None, "not found on the API server", id="claim-missing"),
        pytest.param(_uid_changed, "has uid 'other-uid'", id="claim-recreated"),
        pytest.param(_not_allocated, "not allocated", id="not-allocated"),
    ],
)
def test_a_bad_claim_fails_alone_naming_why(tmp_path: Path, setup: Any, error_part: str) -> None:
    topo = with_gpu(topology(), 6, health=Health.FAILED)
    claims = FakeClaims()
    claims.add(claim_object("good", ["gpu-0"]))
    setup(claims)
    with running_dra(tmp_path, topo, claims) as h:
        resp = _prepare(h, "v1", "bad", "good")
        assert "bad" not in h.plugin.driver.prepared()  # type: ignore[union-attr]
    bad, good = resp.claims["bad"], resp.claims["good"]
    assert error_part in bad.error and "default/claim-bad" in bad.error, bad.error
    assert not bad.devices
    assert good.error == "" and [d.device_name for d in good.devices] == ["gpu-0"]
    assert not claim_spec_path(tmp_path / "cdi", "bad").exists()


@pytest.mark.parametrize(
    ("uid", "namespace", "name", "error_part"),
    [
        pytest.param("", "default", "c", "uid required", id="no-uid"),
        pytest.param("u", "", "c", "namespace required", id="no-namespace"),
        pytest.param("u", "default", "", "name required", id="no-name"),
        pytest.param("u", "a/b", "c", "has no '/'", id="slash"),
        pytest.param("u" * 200, "default", "c", "uid is longer than 128", id="long-uid"),
    ],
)
def test_a_malformed_claim_reference_is_refused(
    tmp_path: Path, uid: str, namespace: str, name: str, error_part: str
) -> None:
    with running_dra(tmp_path, topology()) as h:
        req = dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(uid=uid, namespace=namespace, name=name)])
        resp = h.v1.NodePrepareResources(req, timeout=10)
        assert h.claims.reads == 0
    assert error_part in resp.claims[uid].error


def test_an_api_failure_fails_the_claim_and_a_later_prepare_retries(tmp_path: Path) -> None:
    claims = FakeClaims()
    claims.add(claim_object("u1"))
    claims.error = KubeError(503, "unavailable", "ServiceUnavailable")
    with running_dra(tmp_path, topology(), claims) as h:
        assert "cannot read it: ServiceUnavailable" in _prepare(h, "v1", "u1").claims["u1"].error
        claims.error = None
        assert _prepare(h, "v1", "u1").claims["u1"].error == ""


def test_removed_sockets_are_served_again(tmp_path: Path) -> None:
    with running_dra(tmp_path, topology()) as h:
        server = h.plugin.server
        assert server is not None
        server.dra_socket.unlink()
        server.registration_socket.unlink()
        wait_for(lambda: server.serves == (2, 2), what="both sockets served again")
        wait_for(lambda: server.dra_socket.exists() and server.registration_socket.exists(), what="socket files")
        with grpc.insecure_channel(f"unix://{server.registration_socket.absolute()}") as ch:
            from gputopo.agent.dra.api import pluginregistration_pb2_grpc

            info = pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(
                pluginregistration_pb2.InfoRequest(), timeout=10
            )
        assert info.name == DRIVER


def test_a_stale_socket_is_replaced_and_stop_removes_ours(tmp_path: Path) -> None:
    stale = tmp_path / "registry" / f"{DRIVER}-reg.sock"
    stale.parent.mkdir(parents=True)
    stale.write_text("left by an earlier agent")
    with running_dra(tmp_path, topology()) as h:
        info = h.registration.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=10)
        assert info.name == DRIVER
    assert not stale.exists()
    assert not (tmp_path / "plugins" / DRIVER / "dra.sock").exists()
