"""What a hand-written ResourceClaim spec asks of gputopo's devices, in the shapes gputopo can place. Pure.

A pod under gputopo's scheduler that names its own ResourceClaimTemplate gets gputopo's node choice when
the claim's ask is one the engine knows exactly (`read_claim_ask`):

- **one whole block**: one request whose device class is `clique<N>.gpu.gputopo.io` (exactly, or as
  `firstAvailable`'s first alternative: on the node gputopo chooses a block is free, so the allocator takes
  that one), count 1, `ExactCount`: as `gputopo.io/gpu-clique<N>: 1` (gputopo.model.blockrequest). gputopo's
  own prioritized list (a block, else N single GPUs of one clique) is this case.
- **N single GPUs of one clique**: one request on `gpu.gputopo.io`, count N, `ExactCount`, with a
  `matchAttribute` constraint on `gpu.gputopo.io/nvlinkCliques`, or a `firstAvailable` list of such
  singles each constrained to a clique attribute, which together reach every clique (`nvlinkCliques`, or
  every partition `nvlinkPartition0..3`, as the webhook writes it): as an N-GPU pod under
  `gputopo.io/nvlink: required`. One GPU needs no constraint.

Anything else that names a gputopo class is a `problem`, a sentence naming the template and the field,
never a guess: several blocks (the allocator's blocks need not be linked to each other), `allocationMode:
All`, two requests on gputopo's classes, selectors (gputopo does not evaluate CEL), singles without a
constraint that makes them a clique, a constraint on one partition alone (it reaches that partition's
cliques only), a class under the driver's domain that no DeviceClass of gputopo's is. Requests on other
drivers' classes (NVIDIA's IMEX channel, ...) are not read. Lists are read to the API's bounds (128
requests, 8 alternatives, 32 constraints); each sentence quotes at most 60 characters of any value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.model.dra import (
    ATTR_CLIQUES,
    BLOCK_SIZES,
    DEVICE_CLASS,
    DRIVER,
    MAX_ALLOCATION_RESULTS,
    PARTITIONS,
    block_class,
    partition_attribute,
    qualified,
)
from gputopo.model.podspec import short_repr

MAX_REQUESTS = 128  # DeviceRequestsMaxSize
MAX_ALTERNATIVES = 8  # FirstAvailableDeviceRequestMaxSize
MAX_CONSTRAINTS = 32  # DeviceConstraintsMaxSize
MAX_PROBLEM = 300
CLIQUE_ATTRIBUTES = (qualified(ATTR_CLIQUES), *(qualified(partition_attribute(p)) for p in range(PARTITIONS)))
_BLOCKS = {block_class(s): s for s in BLOCK_SIZES}
_READ_KEYS = frozenset({"name", "deviceClassName", "allocationMode", "count", "selectors"})


@dataclass(frozen=True)
class ClaimAsk:
    """What a claim asks of gputopo's devices: `gpus` GPUs (0: nothing), as one whole block (`block`) or
    as GPUs of one clique; or `problem`, why gputopo cannot place what it asks (then `gpus` is 0)."""

    gpus: int = 0
    block: bool = False
    problem: str = ""

    @property
    def asks(self) -> bool:
        """It asks for gputopo's devices, placeable or not."""
        return bool(self.gpus or self.problem)


NO_ASK = ClaimAsk()


class _Refused(Exception):
    """A shape gputopo does not place; the message is the field and why."""


def ours(device_class: Any) -> bool:
    """A class name under gputopo's driver domain (a class gputopo serves, or one that looks like one)."""
    return isinstance(device_class, str) and (device_class == DRIVER or device_class.endswith("." + DRIVER))


def _short(text: str) -> str:
    return text if len(text) <= MAX_PROBLEM else text[: MAX_PROBLEM - 1] + "…"


def _list(value: Any, where: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Refused(f"{where} is not a list")
    if len(value) > limit:
        raise _Refused(f"{where} has {len(value)} entries; resource.k8s.io/v1 allows {limit}")
    return value


def _alternatives(request: Any, where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """A request's device alternatives, each with its field path: `exactly`, or `firstAvailable`'s."""
    if not isinstance(request, Mapping):
        return []
    exactly = request.get("exactly")
    if isinstance(exactly, Mapping):
        return [(f"{where}.exactly", exactly)]
    found = request.get("firstAvailable")
    if not isinstance(found, list):
        return []
    return [(f"{where}.firstAvailable[{j}]", a) for j, a in enumerate(found[:MAX_REQUESTS]) if isinstance(a, Mapping)]


def _count(alt: Mapping[str, Any], where: str) -> int:
    """The device count of an `ExactCount` alternative (the API's defaults when absent)."""
    extra = sorted(k for k in alt if k not in _READ_KEYS and isinstance(k, str))
    if extra:
        raise _Refused(f"{where}.{extra[0][:60]} is not read by gputopo; it places claims without it")
    if alt.get("selectors"):
        raise _Refused(
            f"{where}.selectors: gputopo does not evaluate CEL selectors, so it cannot tell which nodes serve them"
        )
    mode = alt.get("allocationMode", "ExactCount")
    if mode != "ExactCount":
        raise _Refused(f"{where}.allocationMode: {short_repr(mode, 60)}: gputopo places an exact count of devices")
    count = alt.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_ALLOCATION_RESULTS:
        raise _Refused(
            f"{where}.count: {short_repr(count, 60)} is not a whole number from 1 to {MAX_ALLOCATION_RESULTS}"
        )
    return count


def _covers(constraint: Mapping[str, Any], request: str, sub: str | None) -> bool:
    """Whether `constraint` binds the request (or its subrequest `sub`): no `requests` binds every one."""
    names = constraint.get("requests")
    if not names:
        return True
    return isinstance(names, list) and (request in names or (sub is not None and f"{request}/{sub}" in names))


def _clique_attribute(constraints: Sequence[tuple[str, Mapping[str, Any]]], request: str, sub: str | None) -> str:
    """The one clique attribute the constraints bind this alternative to ("" for none)."""
    found: list[str] = []
    for where, c in constraints:
        if not _covers(c, request, sub):
            continue
        attr = c.get("matchAttribute")
        if set(c) - {"requests", "matchAttribute"} or attr not in CLIQUE_ATTRIBUTES:
            raise _Refused(
                f"{where}: gputopo reads only a matchAttribute on {qualified(ATTR_CLIQUES)} or "
                f"{qualified(partition_attribute(0))}..{PARTITIONS - 1} over its GPUs"
            )
        found.append(str(attr))
    if len(found) > 1:
        raise _Refused(f"{len(found)} constraints bind one request: gputopo reads one clique constraint")
    return found[0] if found else ""


def _block(
    alt: Mapping[str, Any], where: str, constraints: Sequence[tuple[str, Mapping[str, Any]]], request: str
) -> ClaimAsk:
    size = _BLOCKS[alt["deviceClassName"]]
    count = _count(alt, where)
    if count != 1:
        raise _Refused(
            f"{where}.count: {count}: a pod asks for one block (the allocator's {count} blocks need not be "
            "NVLink-connected to each other); run one pod per block"
        )
    sub = alt.get("name") if where.endswith("]") else None
    if any(_covers(c, request, sub if isinstance(sub, str) else None) for _, c in constraints):
        raise _Refused(f"{where}: a constraint binds the block; a block is one whole clique, it needs none")
    return ClaimAsk(gpus=size, block=True)


def _singles(
    alts: list[tuple[str, Mapping[str, Any]]], constraints: Sequence[tuple[str, Mapping[str, Any]]], request: str
) -> ClaimAsk:
    counts: set[int] = set()
    attributes: set[str] = set()
    for where, alt in alts:
        if alt.get("deviceClassName") != DEVICE_CLASS:
            raise _Refused(
                f"{where}.deviceClassName: {short_repr(alt.get('deviceClassName'), 60)} after single GPUs: "
                f"gputopo reads a list of {DEVICE_CLASS} alone, or one that starts with a block"
            )
        counts.add(_count(alt, where))
        sub = alt.get("name") if where.endswith("]") else None
        attr = _clique_attribute(constraints, request, sub if isinstance(sub, str) else None)
        if not attr and max(counts) > 1:
            raise _Refused(
                f"{where}: no matchAttribute constraint on {qualified(ATTR_CLIQUES)} binds these GPUs, so they "
                "need not be one NVLink clique"
            )
        attributes.add(attr)
    if len(counts) > 1:
        raise _Refused(
            f"{short_repr(request, 60)}: its alternatives ask {sorted(counts)} GPUs; gputopo places one count"
        )
    (n,) = counts
    every_partition = {qualified(partition_attribute(p)) for p in range(PARTITIONS)}
    if n > 1 and qualified(ATTR_CLIQUES) not in attributes and not every_partition <= attributes:
        raise _Refused(
            f"{short_repr(request, 60)}: constrained to {', '.join(sorted(attributes))} alone, which holds only "
            f"some cliques; constrain on {qualified(ATTR_CLIQUES)}, or list every partition as gputopo's templates do"
        )
    return ClaimAsk(gpus=n)


def _ask(devices: Mapping[str, Any]) -> ClaimAsk:
    requests = _list(devices.get("requests"), "spec.devices.requests", MAX_REQUESTS)
    asking = []
    for i, r in enumerate(requests):
        alts = _alternatives(r, f"spec.devices.requests[{i}]")
        if any(ours(a.get("deviceClassName")) for _, a in alts):
            asking.append((i, r, alts))
    if not asking:
        return NO_ASK
    if len(asking) > 1:
        one, two = (f"spec.devices.requests[{i}]" for i, _, _ in asking[:2])
        raise _Refused(f"{one} and {two} both ask for gputopo's devices; ask for them in one request")
    i, request, alts = asking[0]
    where = f"spec.devices.requests[{i}]"
    name = request.get("name")
    name = name if isinstance(name, str) else ""
    if len(alts) > MAX_ALTERNATIVES:
        raise _Refused(
            f"{where}.firstAvailable has {len(alts)} alternatives; resource.k8s.io/v1 allows {MAX_ALTERNATIVES}"
        )
    raw = _list(devices.get("constraints"), "spec.devices.constraints", MAX_CONSTRAINTS)
    constraints = [(f"spec.devices.constraints[{j}]", c) for j, c in enumerate(raw) if isinstance(c, Mapping)]
    first_where, first = alts[0]
    device_class = first.get("deviceClassName")
    if isinstance(device_class, str) and device_class in _BLOCKS:
        return _block(first, first_where, constraints, name)
    if device_class == DEVICE_CLASS:
        return _singles(alts, constraints, name)
    if ours(device_class):
        known = ", ".join([DEVICE_CLASS, *_BLOCKS])
        raise _Refused(
            f"{first_where}.deviceClassName: {short_repr(device_class, 60)}: no such class; gputopo's are {known}"
        )
    raise _Refused(
        f"{first_where}.deviceClassName: {short_repr(device_class, 60)} comes first, before gputopo's: "
        "gputopo cannot tell which the allocator takes"
    )


def read_claim_ask(devices: Mapping[str, Any], what: str) -> ClaimAsk:
    """What the claim spec's `devices` asks of gputopo's devices. `what` names the object in a problem
    (`ResourceClaimTemplate ns/name`)."""
    try:
        return _ask(devices)
    except _Refused as e:
        return ClaimAsk(problem=_short(f"{what}: {e}"))


def pod_ask(asks: Iterable[tuple[str, ClaimAsk]], kind: str = "ResourceClaimTemplate") -> tuple[str, ClaimAsk]:
    """A pod's one ask over its templates' (or, `kind` ResourceClaim, its named claims') (name, ask): the one
    that asks, with its name; two that ask are a problem naming both. ("", NO_ASK) when none asks."""
    asking = [(name, a) for name, a in asks if a.asks]
    if not asking:
        return "", NO_ASK
    if len(asking) > 1:
        (a, _), (b, _) = asking[:2]
        both = f"{kind}s {a[:80]} and {b[:80]}"
        return a, ClaimAsk(problem=_short(f"{both} both ask for gputopo's devices; ask for them in one claim"))
    return asking[0]


def template_or_claim(template: str, by_template: ClaimAsk, claim: str, by_claim: ClaimAsk) -> tuple[str, ClaimAsk]:
    """A pod's one hand-written ask over its templates' and its named claims', with what asks it in words
    (`ResourceClaimTemplate t`, `ResourceClaim c`); a template and a named claim that both ask are a problem
    naming both."""
    t, c = f"ResourceClaimTemplate {template[:80]}", f"ResourceClaim {claim[:80]}"
    if by_template.asks and by_claim.asks:
        return t, ClaimAsk(problem=_short(f"{t} and {c} both ask for gputopo's devices; ask for them in one claim"))
    return (c, by_claim) if by_claim.asks else (t, by_template)
