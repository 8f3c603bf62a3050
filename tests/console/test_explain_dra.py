"""`gputopo explain` on a DRA cluster (gputopo/console/inspect.py): the GPUs a pod's ResourceClaim holds,
a clique block counted as its GPUs, are what the node reports it got; a cluster without DRA's API reads
as before."""

from __future__ import annotations

import argparse
import time

import pytest

from gputopo.console import inspect
from gputopo.model.dra import DRIVER
from tests.extender.fake import FakeSource
from tests.extender.harness import lease_obj, node_obj, pod_obj

NODE = "n1"


def _source(dra: bool) -> FakeSource:
    source = FakeSource()
    source.put("nodes", node_obj(NODE, "dgx-h100"))
    source.put("leases", lease_obj(NODE, time.time()))
    pod = pod_obj("p", 4, {"gputopo.io/nvlink": "required"}, node=NODE, phase="Running")
    source.put("pods", pod)
    if not dra:
        source.not_served |= {"resourceslices", "resourceclaims"}
        return source
    devices = [{"name": f"gpu-{i}"} for i in range(8)] + [{"name": "block-4-5-6-7"}]
    pool = {"name": NODE, "generation": 1, "resourceSliceCount": 2}
    spec = {"driver": DRIVER, "nodeName": NODE, "pool": pool, "devices": devices}
    source.put("resourceslices", {"metadata": {"name": f"{NODE}-{DRIVER}"}, "spec": spec})
    result = {"request": "gpus", "driver": DRIVER, "pool": NODE, "device": "block-4-5-6-7"}
    status = {
        "allocation": {"devices": {"results": [result]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": pod["metadata"]["uid"]}],
    }
    source.put("resourceclaims", {"metadata": {"uid": "c", "namespace": "default", "name": "c"}, "status": status})
    return source


@pytest.mark.parametrize(
    ("dra", "line"),
    [
        pytest.param(True, "Actual GPUs 4-7 (reported by the node)", id="a-block-claim-is-its-gpus"),
        pytest.param(False, "Bound to n1", id="no-dra-api-reads-as-before"),
    ],
)
def test_explain_reads_the_gpus_a_pods_claim_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dra: bool, line: str
) -> None:
    monkeypatch.setattr(inspect, "_source", lambda _args: _source(dra))
    args = argparse.Namespace(
        pod="p", namespace="default", stale_after_seconds=120.0, gputopo_namespace="gputopo-system", kubeconfig=None
    )
    assert inspect.run(args) == 0
    out = capsys.readouterr().out
    assert line in out
    assert ("Actual GPUs" in out) is dra
