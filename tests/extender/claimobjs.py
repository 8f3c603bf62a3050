"""Pre-made ResourceClaims and the pods that name them (`resourceClaimName`), for the tests of
gputopo.extender.watch.dramerge's `read_claims` and what the extender does with them."""

from __future__ import annotations

from typing import Any

from gputopo.model.dra import DEVICE_CLASS, DRIVER, block_class
from tests.extender.harness import JSON, pod_obj

CLIQUES = "gpu.gputopo.io/nvlinkCliques"


def quad(count: int = 1) -> dict[str, Any]:
    return {"requests": [{"name": "gpus", "exactly": {"deviceClassName": block_class(4), "count": count}}]}


def singles(n: int) -> dict[str, Any]:
    exactly = {"deviceClassName": DEVICE_CLASS, "count": n}
    return {"requests": [{"name": "gpus", "exactly": exactly}], "constraints": [{"matchAttribute": CLIQUES}]}


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
