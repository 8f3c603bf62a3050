"""The webhook's client authentication from the chart: the CA the API server's client certificate is checked
against, and the names it must carry, reach the extender; one without the other fails the render."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from gputopo.extender.settings import Settings
from tests.chart.helm import by_kind, container, one, render, render_fails, scheduler_config

CA_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
CA = base64.b64encode(CA_PEM.encode()).decode()
ON = {"networkPolicy__webhook__allowFromAnywhere": "true"}


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {
        e["name"]: e.get("value", "")
        for e in container(one(docs, "Deployment", component="scheduler"), "extender")["env"]
    }


def test_the_client_ca_and_names_reach_the_extender() -> None:
    docs = render(
        ["webhook-values.yaml"], webhook__clientAuth__caBundle=CA, webhook__clientAuth__names="{kube-apiserver,b}"
    )
    env = _env(docs)
    assert env["GPUTOPO_WEBHOOK_CLIENT_CA_FILE"] == "/etc/gputopo/client-ca/ca.crt"
    assert env["GPUTOPO_WEBHOOK_CLIENT_NAMES"] == "kube-apiserver,b"
    [cm] = [c for c in by_kind(docs, "ConfigMap") if "ca.crt" in c.get("data", {})]
    assert cm["data"]["ca.crt"].strip() == CA_PEM.strip()
    extender = container(one(docs, "Deployment", component="scheduler"), "extender")
    assert {"name": "webhook-client-ca", "mountPath": "/etc/gputopo/client-ca", "readOnly": True} in extender[
        "volumeMounts"
    ]
    settings = Settings(
        webhook_port=8443,
        tls_cert_file="c",
        tls_key_file="k",
        webhook_client_ca_file=env["GPUTOPO_WEBHOOK_CLIENT_CA_FILE"],
        webhook_client_names=env["GPUTOPO_WEBHOOK_CLIENT_NAMES"],
    )
    assert settings.client_names == {"kube-apiserver", "b"}


def test_by_default_the_extender_gets_no_client_auth() -> None:
    env = _env(render(["webhook-values.yaml"]))
    assert "GPUTOPO_WEBHOOK_CLIENT_CA_FILE" not in env and "GPUTOPO_WEBHOOK_CLIENT_NAMES" not in env


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        pytest.param({"webhook__clientAuth__caBundle": CA}, "needs webhook.clientAuth.names", id="a CA without names"),
        pytest.param(
            {"webhook__clientAuth__names": "{kube-apiserver}"}, "needs webhook.clientAuth.caBundle", id="names, no CA"
        ),
        pytest.param({"webhook__clientAuth__caBundle": "not base64!"}, "caBundle", id="not base64"),
    ],
)
def test_client_auth_values_that_cannot_work_fail_naming_them(sets: dict[str, str], words: str) -> None:
    assert words in render_fails(webhook__enabled="true", **ON, **sets)


@pytest.mark.parametrize(
    ("values", "name"),
    [
        pytest.param({}, "gputopo-scheduler", id="the default profile"),
        pytest.param({"scheduler__schedulerName": "gputopo-preempt"}, "gputopo-preempt", id="a renamed profile"),
    ],
)
def test_the_extender_is_told_the_profile_whose_pods_are_gputopos(values: dict[str, str], name: str) -> None:
    docs = render(**values)
    assert _env(docs)["GPUTOPO_SCHEDULER_NAME"] == name
    assert scheduler_config(docs)["profiles"][0]["schedulerName"] == name  # the profile kube-scheduler serves
