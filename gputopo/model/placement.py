"""The `gputopo.io/placement` pod annotation: what gputopo decided for a pod, and why."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import ConfigDict, Field, Strict, ValidationError

from gputopo.model.base import AnnotationError, Wire, format_validation_error
from gputopo.model.names import PLACEMENT_ANNOTATION
from gputopo.model.quantity import MAX_QUANTITY
from gputopo.model.request import MAX_MESSAGE_BYTES
from gputopo.model.topology import MAX_GPUS_PER_NODE, MAX_TEXT_LENGTH, Name

# Anyone who can edit a pod can write this annotation, and its GPU indices become bit positions: bound
# them to a node's GPUs, and the texts to a few sentences.
_Sentence = Annotated[str, Field(max_length=4 * MAX_TEXT_LENGTH)]
_Score = Annotated[int, Strict(), Field(ge=-MAX_QUANTITY, le=MAX_QUANTITY)]


class _Written(Wire):
    """The placement's parts ignore keys they do not know: the agent's device plugin reads what the
    extender wrote, and an extender newer than the agent (a rolling upgrade) may write more. Every
    known key keeps its bounds."""

    model_config = ConfigDict(extra="ignore")


class RunnerUp(_Written):
    node: Name
    score: _Score
    why: _Sentence


_Millis = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


class CommEstimate(_Written):
    """Predicted communication times of a placement (docs/cost-model.md), in milliseconds."""

    message_bytes: Annotated[int, Strict(), Field(alias="messageBytes", ge=1, le=MAX_MESSAGE_BYTES)]
    # The pod's all-reduce over its own GPUs; absent for one GPU.
    all_reduce_ms: _Millis | None = Field(alias="allReduceMs", default=None)
    # The same all-reduce on the runner-up node's GPUs.
    runner_up_all_reduce_ms: _Millis | None = Field(alias="runnerUpAllReduceMs", default=None)
    # A group member: the transfer to the next stage (the last stage: from the previous one).
    stage_transfer_ms: _Millis | None = Field(alias="stageTransferMs", default=None)
    # A group member: the all-reduce across the group's members (one rank per member, over the NICs).
    group_all_reduce_ms: _Millis | None = Field(alias="groupAllReduceMs", default=None)


_GpuIndex = Annotated[int, Strict(), Field(ge=0, lt=MAX_GPUS_PER_NODE)]
_Count = Annotated[int, Strict(), Field(ge=0, le=4096)]


class TpShare(_Written):
    """One NVLink domain's part of a group's TP split: its TP groups, in stage order."""

    domain: Name
    tp_groups: Annotated[int, Strict(), Field(alias="tpGroups", ge=1, le=4096)]


class TpPlacement(_Written):
    """Where a member's tensor-parallel group lies (docs/annotations.md, "Tensor parallelism across
    nodes"): the same values as the sentence's TP clause, for tools that read the annotation."""

    group: _Count  # 0-based, stage order
    groups: Annotated[int, Strict(), Field(ge=1, le=4096)]
    gpus: Annotated[int, Strict(), Field(ge=1, le=4096)]  # GPUs per TP group
    domain: Name
    split: Annotated[tuple[TpShare, ...], Field(min_length=1, max_length=4096)]
    cap_trays: Annotated[int, Strict(), Field(ge=1, le=4096)] | None = Field(alias="capTrays", default=None)
    left_out_trays: _Count = Field(alias="leftOutTrays", default=0)  # for their NVLink fabric
    message_bytes: Annotated[int, Strict(), Field(alias="messageBytes", ge=1, le=MAX_MESSAGE_BYTES)]
    all_reduce_ms: _Millis = Field(alias="allReduceMs")  # one TP group's, inside one domain
    across_all_reduce_ms: _Millis | None = Field(alias="acrossAllReduceMs", default=None)  # the same over two
    # A fill by trays that ignores TP boundaries: members per domain, and the TP groups it would straddle.
    fill: Annotated[tuple[_Count, ...], Field(max_length=4096)] = ()
    fill_straddles: _Count = Field(alias="fillStraddles", default=0)


class Placement(_Written):
    """What gputopo decided for a pod; written at bind time and read back to rebuild assumed GPUs."""

    node: Name
    gpus: Annotated[tuple[_GpuIndex, ...], Field(max_length=MAX_GPUS_PER_NODE)]
    score: _Score
    reason: _Sentence
    runner_up: RunnerUp | None = Field(alias="runnerUp", default=None)
    group: Name | None = None
    stage: Annotated[int, Strict(), Field(ge=0, le=4096)] | None = None
    estimate: CommEstimate | None = None
    tp: TpPlacement | None = None

    def to_annotation(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"))


def parse_placement(text: str) -> Placement:
    try:
        return Placement.model_validate_json(text)
    except ValidationError as e:
        raise AnnotationError(PLACEMENT_ANNOTATION, text, format_validation_error(e)) from None
