"""Settings (flags win over GPUTOPO_* env), the wire models' casing rules, snapshot mode."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from extender.app import create_app
from extender.main import load_settings
from extender.settings import Settings
from extender.testing import args, gputopo_pod, pod_obj
from extender.wire import ExtenderArgs, ExtenderBindingArgs, ExtenderFilterResult, HostPriority, pod_info


def test_defaults_match_the_configuration_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("HOST", "PORT", "NAMESPACE", "STALE_AFTER_SECONDS", "SNAPSHOT", "KUBECONFIG"):
        monkeypatch.delenv(f"GPUTOPO_{key}", raising=False)
    s = load_settings([])
    assert (s.host, s.port, s.namespace, s.stale_after_seconds, s.reservation_timeout_seconds) == (
        "0.0.0.0",
        8888,
        "gputopo-system",
        120,
        120,
    )
    assert s.snapshot is None and s.kubeconfig is None and s.tls_cert_file is None and s.log_level == "info"


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUTOPO_PORT", "9000")
    monkeypatch.setenv("GPUTOPO_NAMESPACE", "from-env")
    monkeypatch.setenv("GPUTOPO_SCORE_WEIGHTS", '{"clique": 5, "pack": 0}')
    s = load_settings(["--port", "9100", "--stale-after-seconds", "30"])
    assert (s.port, s.namespace, s.stale_after_seconds) == (9100, "from-env", 30)
    assert s.score_weights.clique == 5 and s.score_weights.pack == 0


def test_tls_needs_both_files() -> None:
    with pytest.raises(ValueError, match="must be given together"):
        Settings(tls_cert_file=Path("tls.crt"))


@pytest.mark.parametrize(
    "payload",
    [
        {"Pod": {"metadata": {"name": "p"}}, "Nodes": None, "NodeNames": ["a"]},
        {"pod": {"metadata": {"name": "p"}}, "nodenames": ["a"]},
        {"POD": {"metadata": {"name": "p"}}, "nodeNames": ["a"]},
    ],
    ids=["Go field names", "old lower-case tags", "any casing, like Go's decoder"],
)
def test_extender_args_accept_any_key_casing(payload: dict[str, object]) -> None:
    a = ExtenderArgs.model_validate(payload)
    assert a.candidate_names() == ["a"] and a.nodes is None


def test_results_are_emitted_with_go_field_names() -> None:
    r = ExtenderFilterResult(node_names=["a"], failed_nodes={"b": "x"})
    assert r.to_wire() == {
        "Nodes": None,
        "NodeNames": ["a"],
        "FailedNodes": {"b": "x"},
        "FailedAndUnresolvableNodes": {},
        "Error": "",
    }
    assert HostPriority(host="a", score=7).to_wire() == {"Host": "a", "Score": 7}
    b = ExtenderBindingArgs.model_validate({"podname": "p", "PodNamespace": "ns", "PODUID": "u", "node": "n"})
    assert b.to_wire() == {"PodName": "p", "PodNamespace": "ns", "PodUID": "u", "Node": "n"}


@pytest.mark.parametrize(
    ("spec", "gpus"),
    [
        ({"containers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}, {"resources": {}}]}, 4),
        ({"containers": [{"resources": {"limits": {"nvidia.com/gpu": 2}}}] * 2}, 4),
        ({"containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}]}, 1),
        ({"containers": [{}], "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}, 8),
        ({"containers": [{"resources": {"limits": {"cpu": "1"}}}]}, 0),
    ],
    ids=["sum of container limits", "numeric quantities", "requests when no limit", "init container", "no GPUs"],
)
def test_pod_gpu_count(spec: dict[str, object], gpus: int) -> None:
    assert pod_info({"metadata": {"name": "p"}, "spec": spec}).gpus == gpus


def test_snapshot_mode_serves_a_cluster_file_and_binds_in_memory(tmp_path: Path) -> None:
    f = tmp_path / "cluster.yaml"
    f.write_text(
        "nodes:\n"
        "  - {name: h1, fixture: dgx-h100}\n"
        "  - {name: h2, fixture: hgx-h200, gpusInUse: [0]}\n"
        "  - {name: old, fixture: dgx-a100, stale: true}\n"
    )
    app = create_app(Settings(snapshot=f))
    pod = gputopo_pod("p", 8)
    with TestClient(app) as c:
        assert c.get("/readyz").json() == {"status": "ready", "nodes": 3}
        out = c.post("/filter", json=args(pod, ["h1", "h2", "old"])).json()
        assert out["NodeNames"] == ["h1"]
        assert out["FailedAndUnresolvableNodes"] == {"old": "GPU topology stale"}
        r = c.post("/bind", json={"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "h1"})
        assert r.json() == {"Error": ""}
        again = c.post("/filter", json=args(gputopo_pod("q", 8), ["h1"])).json()
        assert again["FailedNodes"] == {"h1": "fewer than 8 free GPUs"}
        plain = c.post("/bind", json={"PodName": "x", "PodNamespace": "default", "Node": "h2"})
        assert plain.json() == {"Error": ""}
        assert c.post("/filter", json=args(pod_obj("plain", 8), ["h1"])).json()["NodeNames"] == ["h1"]
