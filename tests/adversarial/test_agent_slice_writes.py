"""The ResourceSlices an agent's credentials may write (the chart's agent ValidatingAdmissionPolicy with
agent.dra.enabled). RBAC grants the agent create, update and delete on every ResourceSlice in the cluster;
a compromised node's agent token could otherwise publish devices into another node's pool (the extender and
the allocator key devices by pool: that node's claimed GPUs would count on the wrong node, or its pool go
stale behind a higher generation), publish `gpu.gputopo.io` devices for all nodes (a device without the
attributes our classes' and claims' selectors read fails every node's allocation with a CEL error), or
delete another driver's slices. Bounds: every forged write is refused; what the agent itself writes (its
singles slice, its pool with clique blocks and the counters slice) is admitted, on CREATE, UPDATE and DELETE.

The policy's CEL is read as Python here, after its text is matched exactly (a changed expression fails
first), as tests/chart/test_render.py reads the placement policy's."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.agent.dra.pool import desired_pool
from gputopo.agent.dra.slices import SliceShape, desired_spec
from gputopo.model.dra import DRIVER
from gputopo.systems import build_system
from tests.chart.helm import one, render

NODE = "gpu-a"
OTHER = "gpu-b"
Spec = dict[str, Any]


def _policy_text() -> tuple[str, str]:
    spec = one(render(agent__dra__enabled="true"), "ValidatingAdmissionPolicy", component="agent")["spec"]
    rules = [r for r in spec["matchConstraints"]["resourceRules"] if r["resources"] == ["resourceslices"]]
    assert rules == [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["resourceslices"],
        }
    ]
    variables = {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}
    [check] = [" ".join(v["expression"].split()) for v in spec["validations"] if "isSlice" in v["expression"]]
    return variables["ownSlices"], check


def test_the_policy_text_is_the_one_read_below() -> None:
    own, check = _policy_text()
    assert own == (
        "(request.operation == 'DELETE' ? [oldObject] : request.operation == 'UPDATE' ? [object, oldObject] "
        ": [object]) .all(s, has(s.spec.driver) && s.spec.driver == 'gpu.gputopo.io' && has(s.spec.nodeName) "
        "&& s.spec.nodeName == variables.nodeNames[0] && has(s.spec.pool) && s.spec.pool.name == "
        "variables.nodeNames[0])"
    )
    assert check == "!variables.isSlice || (size(variables.nodeNames) > 0 && variables.ownSlices)"
    # Without DRA the agent has no slice to write: neither RBAC nor the policy names them.
    plain = one(render(), "ValidatingAdmissionPolicy", component="agent")["spec"]
    assert all(r["resources"] != ["resourceslices"] for r in plain["matchConstraints"]["resourceRules"])


def _own(s: Spec, token_node: str) -> bool:
    return (
        s.get("driver") == DRIVER
        and s.get("nodeName") == token_node
        and isinstance(s.get("pool"), dict)
        and s["pool"].get("name") == token_node
    )


def _admitted(operation: str, new: Spec | None, old: Spec | None, token_node: str = NODE) -> bool:
    """The policy's verdict on a slice write by the agent whose token is bound to `token_node`."""
    objects = {"DELETE": [old], "UPDATE": [new, old], "CREATE": [new]}[operation]
    return all(s is not None and _own(s, token_node) for s in objects)


def _slice(node: str = NODE, pool: str | None = None, driver: str = DRIVER, **spec: Any) -> Spec:
    out: Spec = {"driver": driver, "pool": {"name": node if pool is None else pool, "resourceSliceCount": 1}}
    if node:
        out["nodeName"] = node
    return {**out, **spec}


TOPOLOGY = build_system("dgx-h100", NODE)
SINGLES = desired_spec(NODE, TOPOLOGY, SliceShape(list_attributes=False, device_taints=False))
POOL = desired_pool(NODE, TOPOLOGY, SliceShape(list_attributes=False, device_taints=False, blocks=True))


@pytest.mark.parametrize(
    ("operation", "new", "old"),
    [
        pytest.param("CREATE", _slice(OTHER), None, id="another-node's-slice"),
        pytest.param("CREATE", _slice(NODE, pool=OTHER), None, id="own-node-but-another-node's-pool"),
        pytest.param("CREATE", _slice(OTHER, pool=NODE), None, id="own-pool-on-another-node"),
        pytest.param("CREATE", _slice("", allNodes=True), None, id="our-driver-for-all-nodes"),
        pytest.param("CREATE", _slice("", nodeSelector={"nodeSelectorTerms": []}), None, id="our-driver-by-selector"),
        pytest.param("CREATE", _slice(NODE, driver="gpu.nvidia.com"), None, id="another-driver-on-its-own-node"),
        pytest.param("UPDATE", _slice(NODE), _slice(OTHER), id="another-node's-slice-moved-here"),
        pytest.param("UPDATE", _slice(NODE, pool=OTHER), _slice(NODE), id="own-slice-moved-into-another-pool"),
        pytest.param(
            "UPDATE",
            _slice(NODE, driver="x.example.com"),
            _slice(NODE, driver="x.example.com"),
            id="another-driver's-slice",
        ),
        pytest.param("DELETE", None, _slice(OTHER), id="delete-another-node's-slice"),
        pytest.param("DELETE", None, _slice(NODE, driver="gpu.nvidia.com"), id="delete-another-driver's-slice"),
    ],
)
def test_a_forged_slice_write_is_refused(operation: str, new: Spec | None, old: Spec | None) -> None:
    _policy_text()  # the expressions read here are the chart's
    assert not _admitted(operation, new, old)


@pytest.mark.parametrize(
    "spec",
    [pytest.param(SINGLES, id="singles-slice")] + [pytest.param(s, id=name) for name, s in POOL.items()],
)
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_what_the_agent_writes_is_admitted(operation: str, spec: Spec) -> None:
    assert len(POOL) >= 2  # the counters slice and a device slice: blocks on a DGX H100
    _policy_text()
    assert _admitted(operation, spec, spec)
    assert not _admitted(operation, spec, spec, token_node=OTHER)
