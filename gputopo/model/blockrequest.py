"""A pod's request for one NVLink clique block through an extended resource (KEP-5004): the pod asks
`gputopo.io/gpu-clique<N>: 1` and kube-scheduler makes it a claim on the DeviceClass whose
`extendedResourceName` that is (`gputopo.model.dra.block_class(N)`). Pure: no I/O.

What gputopo places is one block per pod: N GPUs that are one clique, as the engine places any pod of
N GPUs under `gputopo.io/nvlink: required`. Everything else a pod could say through these resources is
refused with a sentence naming the resource (`BlockAsk.problem`), never guessed at:

- `gputopo.io/gpu-clique4: 2` (k > 1): the allocator would give two blocks of 4 that need not be
  linked to each other, and the engine places one GPU set per pod; a set of 8 would refuse nodes the
  allocator can serve, and two sets are no request the engine knows. Ask k pods, or one claim.
- two block resources, or a block beside `nvidia.com/gpu` or a gputopo claim template: two
  allocations on one pod, the same question.
- a name under the prefix with a size not in `BLOCK_SIZES` (`gpu-clique3`, `gpu-clique04`): no class
  serves it, so kube-scheduler would leave the pod pending without a word; gputopo says why.

A count is read by Kubernetes' rules (gputopo.model.podspec: requests and limits, init containers and
sidecars); a count that is not a whole non-negative quantity raises `PodSpecError` as for
nvidia.com/gpu. A count of 0 asks for nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.model.dra import BLOCK_RESOURCE_PREFIX, BLOCK_SIZES, block_resource
from gputopo.model.podspec import read_pod_gpus, short_repr

MAX_RESOURCE_NAMES = 64  # names under the prefix read per container: an API server caps the object anyway


@dataclass(frozen=True)
class BlockAsk:
    """The block a pod asks for: `size` GPUs as one whole block (0: none), or `problem` saying why what
    it asks cannot be placed (then `size` is 0)."""

    size: int = 0
    problem: str = ""


NO_BLOCK = BlockAsk()


def _names_under_prefix(spec: Mapping[str, Any]) -> set[str]:
    """The resource names under BLOCK_RESOURCE_PREFIX any container names (requests or limits)."""
    out: set[str] = set()
    for key in ("containers", "initContainers"):
        containers = spec.get(key)
        for c in containers if isinstance(containers, list) else ():
            resources = c.get("resources") if isinstance(c, Mapping) else None
            for kind in ("requests", "limits"):
                values = resources.get(kind) if isinstance(resources, Mapping) else None
                if not isinstance(values, Mapping):
                    continue
                for name in values:
                    if isinstance(name, str) and name.startswith(BLOCK_RESOURCE_PREFIX):
                        out.add(name)
                        if len(out) > MAX_RESOURCE_NAMES:
                            return out
    return out


def read_block_ask(spec: Mapping[str, Any], where: str = "Pod.spec", other_gpus: int = 0) -> BlockAsk:
    """The block `spec` asks for through `gputopo.io/gpu-clique<N>`. `other_gpus`: the GPUs it also asks
    for another way (nvidia.com/gpu, gputopo's claim templates). Raises PodSpecError for a count that is
    no whole non-negative quantity, naming the field."""
    names = _names_under_prefix(spec)
    if not names:
        return NO_BLOCK
    known = {block_resource(s): s for s in BLOCK_SIZES}
    unknown = sorted(n for n in names if n not in known)
    if unknown:
        sizes = ", ".join(map(str, BLOCK_SIZES))
        return BlockAsk(problem=f"{short_repr(unknown[0], 60)}: no such block resource; blocks are {sizes} GPUs")
    asked = [(name, read_pod_gpus(spec, where, name).total) for name in sorted(names, key=known.__getitem__)]
    asked = [(name, count) for name, count in asked if count > 0]
    if not asked:
        return NO_BLOCK
    if len(asked) > 1:
        both = " and ".join(name for name, _ in asked)
        return BlockAsk(problem=f"{both}: a pod asks for one block; run one pod per block")
    name, count = asked[0]
    if count > 1:
        return BlockAsk(
            problem=f"{name}: {count}: a pod asks for one block (the allocator's {count} blocks need not be "
            "NVLink-connected to each other); run one pod per block"
        )
    if other_gpus:
        return BlockAsk(problem=f"{name} beside {other_gpus} other GPUs: ask for GPUs one way, a block or a count")
    return BlockAsk(size=known[name])
