"""Settings (flags win over GPUTOPO_* env), the wire models' casing rules, snapshot mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputopo.extender.app import create_listeners
from gputopo.extender.main import load_settings, main
from gputopo.extender.settings import Settings
from gputopo.extender.wire import ExtenderArgs, pod_info
from tests.extender.harness import Env, args, call, gputopo_pod, node_obj, pod_obj
from tests.paths import REPO


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("GPUTOPO_"):
            monkeypatch.delenv(key)


@pytest.mark.usefixtures("clean_env")
def test_defaults_match_the_configuration_reference() -> None:
    s = load_settings([])
    assert (s.host, s.port, s.namespace, s.stale_after_seconds, s.reservation_timeout_seconds) == (
        "127.0.0.1",
        8888,
        "gputopo-system",
        120,
        120,
    )
    assert (s.webhook_host, s.webhook_port, s.metrics_host, s.metrics_port) == ("0.0.0.0", 0, "0.0.0.0", 9402)
    assert s.snapshot is None and s.kubeconfig is None and s.tls_cert_file is None and s.log_level == "info"


@pytest.mark.usefixtures("clean_env")
def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUTOPO_PORT", "9000")
    monkeypatch.setenv("GPUTOPO_NAMESPACE", "from-env")
    monkeypatch.setenv("GPUTOPO_METRICS_PORT", "9500")
    monkeypatch.setenv("GPUTOPO_SCORE_WEIGHTS", '{"clique": 5, "pack": 0}')
    s = load_settings(["--port", "9100", "--stale-after-seconds", "30", "--metrics-port=0"])
    assert (s.port, s.namespace, s.stale_after_seconds, s.metrics_port) == (9100, "from-env", 30, 0)
    assert s.score_weights.clique == 5 and s.score_weights.pack == 0


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        pytest.param(
            ["--host", "0.0.0.0"], {}, "--host 0.0.0.0 is not a loopback address", id="verbs on all addresses"
        ),
        pytest.param([], {"GPUTOPO_HOST": "10.0.0.7"}, "--host 10.0.0.7 is not a loopback", id="verbs on a pod IP"),
        pytest.param(["--port", "0"], {}, "--port (GPUTOPO_PORT): Input should be greater", id="verbs port 0"),
        pytest.param(["--webhook-port", "8443"], {}, "--webhook-port needs --tls-cert-file", id="webhook without TLS"),
        pytest.param(
            ["--tls-cert-file", "c", "--tls-key-file", "k"], {}, "set --webhook-port", id="TLS without the webhook"
        ),
        pytest.param(["--tls-cert-file", "c"], {}, "must be given together", id="certificate without key"),
        pytest.param(["--metrics-port", "8888"], {}, "--port and --metrics-port are both 8888", id="ports collide"),
        pytest.param(
            [], {"GPUTOPO_STALE_AFTER_SECONDS": "0"}, "--stale-after-seconds (GPUTOPO_STALE_AFTER_SECONDS)", id="env"
        ),
        pytest.param(["--log-level", "loud"], {}, "--log-level (GPUTOPO_LOG_LEVEL)", id="bad log level"),
        pytest.param(["--max-request-bytes", "x"], {}, "--max-request-bytes", id="not a number"),
        pytest.param(["--listen", "1"], {}, "unrecognized arguments: --listen", id="unknown flag"),
    ],
)
def test_invalid_settings_exit_2_naming_the_flag(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gputopo-extender: ") and message in err, err


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_the_verbs_listen_on_any_loopback_address(host: str) -> None:
    assert load_settings(["--host", host]).host == host


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


@pytest.mark.parametrize("lower", [False, True], ids=["Go-cased request", "lower-cased request"])
def test_every_verb_answers_with_go_field_names_whatever_the_request_casing(env: Env, lower: bool) -> None:
    # kube-scheduler decodes answers with Go's encoding/json: exact field names, whatever it was sent.
    env.add_nodes(node_obj("gpu-1"))
    pod = gputopo_pod("p", 4)
    env.add_pods(pod)
    filtered = env.call("filter", args(pod, ["gpu-1", "gone"], lower=lower)).json()
    assert set(filtered) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert filtered["NodeNames"] == ["gpu-1"]
    prioritized = env.call("prioritize", args(pod, ["gpu-1", "gone"], lower=lower)).json()
    assert [set(h) for h in prioritized] == [{"Host", "Score"}]
    meta = pod["metadata"]
    bind = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": "gpu-1"}
    bound = env.call("bind", {k.lower(): v for k, v in bind.items()} if lower else bind).json()
    assert bound == {"Error": ""}


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
    listeners = create_listeners(Settings(snapshot=f))
    pod = gputopo_pod("p", 8)
    door = listeners.door
    with listeners.running():
        assert call(door, "readyz").json() == {"status": "ready", "nodes": 3}
        out = call(door, "filter", args(pod, ["h1", "h2", "old"])).json()
        assert out["NodeNames"] == ["h1"]
        stale = call(door, "filter", args(pod, ["old"])).json()
        assert stale["FailedAndUnresolvableNodes"] == {"old": "GPU topology stale"}
        r = call(door, "bind", {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "h1"})
        assert r.json() == {"Error": ""}
        again = call(door, "filter", args(gputopo_pod("q", 8), ["h1"])).json()
        assert again["FailedNodes"] == {"h1": "fewer than 8 free GPUs"}
        plain = call(door, "bind", {"PodName": "x", "PodNamespace": "default", "Node": "h2"})
        assert plain.json() == {"Error": ""}
        assert call(door, "filter", args(pod_obj("plain", 8), ["h1"])).json()["NodeNames"] == ["h1"]


def test_every_setting_is_in_the_configuration_reference() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    section = text[text.index("## gputopo-extender") : text.index("## gputopo-agent")]
    for field in Settings.model_fields:
        env = f"`GPUTOPO_{field.upper()}`"
        assert env in section, env
        if field not in ("score_weights", "tiers"):  # environment only (JSON)
            assert f"| `--{field.replace('_', '-')}` | {env} |" in section, field
