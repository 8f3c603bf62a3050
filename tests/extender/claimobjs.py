"""Hand-written ResourceClaimTemplates, pre-made ResourceClaims and the pods that name them
(`resourceClaimTemplateName`, `resourceClaimName`), for the tests of what the extender reads of a pod's own
claims (gputopo.model.claimask) and does with them."""

from __future__ import annotations

from typing import Any

from gputopo.model.dra import DEVICE_CLASS, DRIVER, block_class
from tests.extender.harness import JSON, Env, node_obj, pod_obj

CLIQUES = "gpu.gputopo.io/nvlinkCliques"


TRIO = ["whole", "half", "broken"]


def quad(count: int = 1) -> dict[str, Any]:
    exactly = {"deviceClassName": block_class(4), "allocationMode": "ExactCount", "count": count}
    return {"requests": [{"name": "gpus", "exactly": exactly}]}


def singles(n: int) -> dict[str, Any]:
    exactly = {"deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": n}
    return {"requests": [{"name": "gpus", "exactly": exactly}], "constraints": [{"matchAttribute": CLIQUES}]}


def template_obj(name: str, devices: dict[str, Any], ns: str = "default") -> JSON:
    return {"metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": devices}}}


def block_pod(name: str) -> JSON:
    """The same block asked by extended resource: what a pod's own block claim is compared with."""
    pod = pod_obj(name, 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"gputopo.io/gpu-clique4": "1"}}
    return pod


def add_trio(env: Env) -> None:
    """Three DGX-1V nodes (quads 0-3 and 4-7): `whole` all free, `half` with GPU 1 busy (quad 4-7 free),
    `broken` with GPUs 1 and 5 busy (no free quad)."""
    env.add_nodes(
        node_obj("whole", "dgx-1v"), node_obj("half", "dgx-1v", in_use=[1]), node_obj("broken", "dgx-1v", in_use=[1, 5])
    )


ASKS = (("quad", quad()), ("two-quads", quad(2)), ("clique4", singles(4)), ("clique2", singles(2)))


def claim_obj(
    name: str, devices: dict[str, Any], ns: str = "default", *, on: str = "", gpus: tuple[int, ...] = (), to: str = ""
) -> JSON:
    """A pre-made claim asking `devices`; with `on`, allocated GPUs `gpus` of node `on`'s pool, reserved for
    pod UID `to` (none when empty)."""
    obj: JSON = {"metadata": {"name": name, "namespace": ns, "uid": f"claim-{ns}-{name}"}, "spec": {"devices": devices}}
    if on:
        results = [{"request": "gpus", "driver": DRIVER, "pool": on, "device": f"gpu-{g}"} for g in gpus]
        obj["status"] = {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": to}] if to else [],
        }
    return obj


def claim_pod(
    name: str, *claims: str, ns: str = "default", resources: dict[str, str] | None = None, **ann: str
) -> JSON:
    """A pod under gputopo-scheduler naming the pre-made `claims`, with `resources` (limits) beside them."""
    pod = pod_obj(name, 0, {f"gputopo.io/{k}": v for k, v in ann.items()} or None, namespace=ns)
    pod["spec"]["containers"][0]["resources"] = {
        "limits": dict(resources or {}),
        "claims": [{"name": f"c{i}"} for i in range(len(claims))],
    }
    pod["spec"]["resourceClaims"] = [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    return pod
