"""The chart's NetworkPolicies: which pods they select, which ports they open and to whom."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.chart.helm import CHART, Doc, by_kind, container, one, render, render_fails

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CIDR = re.compile(SCHEMA["definitions"]["cidr"]["pattern"])
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())

TEST_POD = {
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/name": "gputopo",
            "app.kubernetes.io/instance": "gputopo",
            "app.kubernetes.io/component": "test",
        }
    }
}


def _namespaces(*names: str) -> Doc:
    return {
        "namespaceSelector": {
            "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(names)}]
        }
    }


def _ip_blocks(*cidrs: str) -> list[Doc]:
    return [{"ipBlock": {"cidr": c}} for c in cidrs]


def _render_values(tmp_path: Path, values: dict[str, Any]) -> list[Doc]:
    # Lists (empty ones included) are awkward through --set; a values file says them plainly.
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return render([path])


def _policy(docs: list[Doc], component: str) -> Doc:
    return one(docs, "NetworkPolicy", component=component)


def _rule_for_port(policy: Doc, port: int | str) -> Doc | None:
    rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r["ports"])]
    assert len(rules) <= 1
    return rules[0] if rules else None


# --- which policies exist, which pods they select ----------------------------------------


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param({}, {"scheduler", "agent"}, id="on by default, one per component"),
        pytest.param({"networkPolicy__enabled": "false"}, set(), id="off renders nothing"),
        pytest.param({"agent__enabled": "false"}, {"scheduler"}, id="no agent, no agent policy"),
        pytest.param({"scheduler__enabled": "false"}, {"agent"}, id="no scheduler pods, no scheduler policy"),
    ],
)
def test_a_policy_is_rendered_for_each_enabled_component(sets: dict[str, str], expected: set[str]) -> None:
    policies = by_kind(render(**sets), "NetworkPolicy")
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in policies} == expected


@pytest.mark.parametrize(
    ("component", "workload", "other"),
    [("scheduler", "Deployment", "DaemonSet"), ("agent", "DaemonSet", "Deployment")],
)
def test_each_policy_selects_its_own_pods_only_and_restricts_ingress_only(
    component: str, workload: str, other: str
) -> None:
    docs = render(scheduler__podLabels__team="ml", agent__podLabels__team="ml")
    selector = _policy(docs, component)["spec"]["podSelector"]["matchLabels"]
    own = one(docs, workload)["spec"]["template"]["metadata"]["labels"]
    others = one(docs, other)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= own.items()
    assert not selector.items() <= others.items()
    # Egress stays open: the pods' only destination is the API server, which no policy can name.
    assert _policy(docs, component)["spec"]["policyTypes"] == ["Ingress"]


# --- the metrics ports -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "tests_enabled", "expected_peers"),
    [
        pytest.param({}, True, [_namespaces("monitoring"), TEST_POD], id="defaults: monitoring and the test Pod"),
        pytest.param(
            {"namespaces": ["prometheus", "observability"]},
            False,
            [_namespaces("prometheus", "observability")],
            id="own namespaces, tests off",
        ),
        pytest.param(
            {"namespaces": [], "nodeCIDRs": ["10.0.0.0/16", "fd00:1::/64"]},
            True,
            [*_ip_blocks("10.0.0.0/16", "fd00:1::/64"), TEST_POD],
            id="node ranges only",
        ),
        pytest.param(
            {"nodeCIDRs": ["192.168.0.0/24"]},
            True,
            [_namespaces("monitoring"), *_ip_blocks("192.168.0.0/24"), TEST_POD],
            id="namespaces and node ranges",
        ),
    ],
)
def test_scheduler_metrics_ports_admit_exactly_the_configured_peers(
    tmp_path: Path, metrics: Doc, tests_enabled: bool, expected_peers: list[Doc]
) -> None:
    docs = _render_values(
        tmp_path,
        {"networkPolicy": {"metrics": metrics}, "tests": {"enabled": tests_enabled}, "extender": {"metricsPort": 9500}},
    )
    policy = _policy(docs, "scheduler")
    rule = _rule_for_port(policy, 9500)
    assert rule is not None
    assert rule["from"] == expected_peers
    # kube-scheduler's own authorised /metrics, by the name of its container port.
    assert [p["port"] for p in rule["ports"]] == [9500, "https"]
    kube_scheduler_ports = container(one(docs, "Deployment"), "kube-scheduler")["ports"]
    assert [p["containerPort"] for p in kube_scheduler_ports if p["name"] == "https"] == [10259]


@pytest.mark.parametrize(
    ("metrics", "agent_port", "expected_peers"),
    [
        pytest.param({}, 9401, [_namespaces("monitoring")], id="defaults: monitoring, no test Pod"),
        pytest.param(
            {"namespaces": ["prometheus"], "nodeCIDRs": ["10.1.0.0/16"]},
            9411,
            [_namespaces("prometheus"), *_ip_blocks("10.1.0.0/16")],
            id="own peers and port",
        ),
        pytest.param({}, 0, None, id="metrics off: nothing listens, nothing admitted"),
        pytest.param({"namespaces": []}, 9401, None, id="no peer: no rule"),
    ],
)
def test_agent_metrics_port_admits_exactly_the_configured_peers(
    tmp_path: Path, metrics: Doc, agent_port: int, expected_peers: list[Doc] | None
) -> None:
    docs = _render_values(tmp_path, {"networkPolicy": {"metrics": metrics}, "agent": {"metricsPort": agent_port}})
    ingress = _policy(docs, "agent")["spec"]["ingress"]
    if expected_peers is None:
        assert ingress == []
    else:
        assert ingress == [{"ports": [{"port": agent_port, "protocol": "TCP"}], "from": expected_peers}]


def test_no_metrics_peer_admits_nobody_rather_than_everybody(tmp_path: Path) -> None:
    # A rule whose "from" is empty would admit every source: with no peer the rule must go.
    docs = _render_values(tmp_path, {"networkPolicy": {"metrics": {"namespaces": []}}, "tests": {"enabled": False}})
    assert _policy(docs, "scheduler")["spec"]["ingress"] == []
    assert _policy(docs, "agent")["spec"]["ingress"] == []


# --- the webhook port and the verbs port -------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected_from"),
    [
        pytest.param(
            {"webhook": {"enabled": True}, "networkPolicy": {"webhook": {"allowFromAnywhere": True}}},
            None,
            id="opted out: from anywhere",
        ),
        pytest.param(
            {
                "webhook": {"enabled": True, "port": 9443},
                "networkPolicy": {"webhook": {"apiServerCIDRs": ["10.0.0.0/24"]}},
            },
            [*_ip_blocks("10.0.0.0/24"), TEST_POD],
            id="API server range and the test Pod",
        ),
        pytest.param(
            {
                "webhook": {"enabled": True},
                "tests": {"enabled": False},
                "networkPolicy": {"webhook": {"apiServerCIDRs": ["172.16.0.0/28", "fd00:ab::/120"]}},
            },
            _ip_blocks("172.16.0.0/28", "fd00:ab::/120"),
            id="API server ranges, tests off",
        ),
    ],
)
def test_webhook_port_admits_the_api_server_ranges_or_anyone_when_opted_out(
    tmp_path: Path, values: Doc, expected_from: list[Doc] | None
) -> None:
    docs = _render_values(tmp_path, values)
    port = values["webhook"].get("port", DEFAULTS["webhook"]["port"])
    rule = _rule_for_port(_policy(docs, "scheduler"), port)
    assert rule is not None
    assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
    assert rule.get("from") == expected_from
    extender_ports = container(one(docs, "Deployment"), "extender")["ports"]
    assert {"name": "webhook", "containerPort": port, "protocol": "TCP"} in extender_ports


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        pytest.param(
            {"webhook__enabled": "true"},
            ["networkPolicy.webhook.apiServerCIDRs", "networkPolicy.webhook.allowFromAnywhere=true", "open to anyone"],
            id="webhook on, no ranges and none to look up: fails naming both ways out",
        ),
        pytest.param(
            {
                "webhook__enabled": "true",
                "networkPolicy__webhook__allowFromAnywhere": "true",
                "networkPolicy__webhook__apiServerCIDRs": "{10.0.0.0/24}",
            },
            ["exclusive"],
            id="ranges and from anywhere at once",
        ),
    ],
)
def test_the_webhook_port_is_never_opened_to_anyone_silently(sets: dict[str, str], words: list[str]) -> None:
    """H1: an empty range list used to render a rule that admits everyone. helm template has no cluster to
    look the API server up in, which is the case here; with one, its addresses are admitted."""
    err = render_fails(**sets)
    for w in words:
        assert w in err


def test_without_the_network_policy_the_webhook_needs_no_ranges() -> None:
    docs = render(webhook__enabled="true", networkPolicy__enabled="false")
    assert by_kind(docs, "MutatingWebhookConfiguration") and not by_kind(docs, "NetworkPolicy")


@pytest.mark.parametrize(
    "values_file",
    ["default-values.yaml", "webhook-values.yaml", "cert-manager-values.yaml", "custom-tiers-values.yaml"],
)
def test_only_the_webhook_port_can_be_open_to_anyone_and_the_verbs_port_never_is(values_file: str) -> None:
    docs = render([values_file])
    webhook_on = bool(by_kind(docs, "MutatingWebhookConfiguration"))
    for policy in by_kind(docs, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            ports = [p["port"] for p in rule["ports"]]
            assert DEFAULTS["extender"]["port"] not in ports
            if not rule.get("from"):
                assert webhook_on and ports == [DEFAULTS["webhook"]["port"]], policy["metadata"]["name"]
        if not webhook_on:
            assert _rule_for_port(policy, DEFAULTS["webhook"]["port"]) is None


# --- bad values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param(
            {"networkPolicy__metrics__namespaces": "{Monitoring}"},
            "at '/networkPolicy/metrics/namespaces/0': 'Monitoring'",
            id="namespace not a DNS label",
        ),
        pytest.param(
            {"networkPolicy__metrics__nodeCIDRs": "{10.0.0.0}"},
            "at '/networkPolicy/metrics/nodeCIDRs/0': '10.0.0.0'",
            id="address without a prefix length",
        ),
        pytest.param(
            {"networkPolicy__metrics__nodeCIDRs": "{10.0.0.0/8,10.0.0.256/32}"},
            "at '/networkPolicy/metrics/nodeCIDRs/1': '10.0.0.256/32'",
            id="octet out of range, second item",
        ),
        pytest.param(
            {"networkPolicy__webhook__apiServerCIDRs": "{fd00::/129}"},
            "at '/networkPolicy/webhook/apiServerCIDRs/0': 'fd00::/129'",
            id="IPv6 prefix too long",
        ),
        pytest.param(
            {"networkPolicy__webhook__apiServerCIDRs": "{kubernetes.default.svc}"},
            "at '/networkPolicy/webhook/apiServerCIDRs/0': 'kubernetes.default.svc'",
            id="a host name is not a range",
        ),
        pytest.param(
            {"networkPolicy__metrics__namespace": "{monitoring}"},
            "additional properties 'namespace' not allowed",
            id="misspelt key",
        ),
        pytest.param({"networkPolicy__enabled": "yes"}, "at '/networkPolicy/enabled'", id="enabled not a boolean"),
    ],
)
def test_schema_refuses_bad_values_naming_them(sets: dict[str, str], expected: str) -> None:
    assert expected in render_fails(**sets)


networks = st.one_of(
    st.builds(ipaddress.IPv4Network, st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 32)), st.just(False)),
    st.builds(ipaddress.IPv6Network, st.tuples(st.integers(0, 2**128 - 1), st.integers(0, 128)), st.just(False)),
)


@given(networks, st.booleans())
def test_schema_cidr_pattern_accepts_every_network_as_written(net: Any, exploded: bool) -> None:
    text = net.exploded if exploded else str(net)
    assert CIDR.search(text), text


@given(st.text(alphabet="0123456789abcdefABCDEF:./ -", max_size=45))
def test_schema_cidr_pattern_accepts_only_what_parses_as_a_network(text: str) -> None:
    if CIDR.search(text):
        ipaddress.ip_network(text, strict=False)  # raises on anything that is not a network
