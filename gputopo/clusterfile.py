"""`cluster.yaml` and `jobs.yaml` (docs/simulator.md, "Files"): the simulator's input and the
extender's `--snapshot` source. Errors name the file, the entry and the field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import ANN_GROUP, ANN_GROUP_SIZE, ANN_STAGE, NodeTopology
from gputopo.systems import RACKS, UnknownSystemError, build_system, check_tray_numbers, rack_trays, tray_count
from gputopo.tiers import DEFAULT_TIERS, TierConfig

M = TypeVar("M", bound=BaseModel)


class ClusterFileError(ValueError):
    """A cluster or jobs file that cannot be used; the message names the file and the entry."""


class NodeSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    name: str = Field(min_length=1)
    fixture: str | None = None
    topology: NodeTopology | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    gpus_in_use: list[int] = Field(alias="gpusInUse", default_factory=list)
    stale: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> NodeSpec:
        if (self.fixture is None) == (self.topology is None):
            raise ValueError("give exactly one of 'fixture' (a named system) or 'topology' (an inline document)")
        return self

    def resolve_topology(self) -> NodeTopology:
        if self.topology is not None:
            return self.topology
        assert self.fixture is not None
        return build_system(self.fixture, self.name)


class RackSpec(BaseModel):
    """A named rack (`gb200-nvl72`, `gb300-nvl72`): its trays are nodes `<name>-tray-NN` of one NVLink domain."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    system: str
    trays: int | None = None  # default: the rack's full count (18)
    labels: dict[str, str] = Field(default_factory=dict)  # on every tray
    degraded: list[int] = Field(default_factory=list)  # tray numbers whose GPU 2 reports degraded fabric
    gpus_in_use: dict[int, list[int]] = Field(alias="gpusInUse", default_factory=dict)  # tray number -> GPUs

    @field_validator("system")
    @classmethod
    def _known(cls, system: str) -> str:
        if system not in RACKS:
            raise ValueError(f"unknown rack system {system!r}; known: {', '.join(sorted(RACKS))}")
        return system

    @field_validator("trays")
    @classmethod
    def _tray_count(cls, trays: int | None, info: ValidationInfo) -> int | None:
        if trays is not None and info.data.get("system") in RACKS:
            tray_count(info.data["system"], trays)
        return trays

    @field_validator("degraded", "gpus_in_use")
    @classmethod
    def _trays_exist(cls, value: list[int] | dict[int, list[int]], info: ValidationInfo) -> object:
        if info.data.get("system") not in RACKS or "trays" not in info.data:
            return value  # the system or the count is already reported
        count = tray_count(info.data["system"], info.data["trays"])
        check_tray_numbers(count, value, "degraded" if info.field_name == "degraded" else "in-use")
        if isinstance(value, dict):
            gpus = len(build_system(RACKS[info.data["system"]].tray).gpus)
            for tray, in_use in value.items():
                bad = [g for g in in_use if not 0 <= g < gpus]
                if bad:
                    raise ValueError(f"tray {tray}: {bad} out of range for {gpus} GPUs")
        return value

    def expand(self) -> list[NodeSpec]:
        """One node per tray, named `<name>-tray-NN`, with the rack's labels."""
        return [
            NodeSpec(name=node, fixture=tray, labels=self.labels, gpus_in_use=self.gpus_in_use.get(t, []))
            for t, (node, tray) in enumerate(rack_trays(self.system, self.name, self.trays, self.degraded), start=1)
        ]


class ClusterSpec(BaseModel):
    """The file's `nodes`, then every rack's trays (expanded when the file is read)."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[NodeSpec] = Field(default_factory=list)
    racks: list[RackSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        seen: dict[str, str] = {}
        for i, n in enumerate(self.nodes):
            if n.name in seen:
                raise ValueError(f"node name {n.name!r} appears twice")
            seen[n.name] = f"nodes[{i}]"
        trays = []
        for i, r in enumerate(self.racks):
            for t in r.expand():
                if t.name in seen:
                    raise ValueError(f"racks[{i}] ({r.name}).name: tray node {t.name!r} is also {seen[t.name]}")
                seen[t.name] = f"racks[{i}] ({r.name})"
                trays.append(t)
        self.nodes = [*self.nodes, *trays]
        return self


class JobSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    pods: int = Field(1, ge=1, le=4096)
    gpus_per_pod: int = Field(alias="gpusPerPod", ge=0, le=64)
    # Each pod's GPUs where a group's pods differ (a JobSet's driver asks for none): one per pod.
    gpus_by_pod: list[Annotated[int, Field(ge=0, le=64)]] | None = Field(None, alias="gpusByPod")
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_count_per_pod(self) -> JobSpec:
        if self.gpus_by_pod is not None and len(self.gpus_by_pod) != self.pods:
            raise ValueError(f"gpusByPod names {len(self.gpus_by_pod)} pods; the job has {self.pods}")
        return self

    def gpus_of(self, i: int) -> int:
        """Pod i's GPUs: its entry of gpusByPod, else gpusPerPod."""
        return self.gpus_by_pod[i] if self.gpus_by_pod is not None else self.gpus_per_pod

    def pod_annotations(self, i: int) -> dict[str, str]:
        """A job of several pods is one group: name, size and stage unless the job sets them."""
        ann = dict(self.annotations)
        if self.pods > 1:
            ann.setdefault(ANN_GROUP, self.name)
            ann.setdefault(ANN_GROUP_SIZE, str(self.pods))
            ann.setdefault(ANN_STAGE, str(i))
        return ann


class JobsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSpec]


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as e:
        raise ClusterFileError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ClusterFileError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise ClusterFileError(f"{path}: nested too deeply") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ClusterFileError(f"{path}: not valid YAML{where} ({problem})") from None


def _explain(path: Path, err: ValidationError, data: Any) -> ClusterFileError:
    msgs = []
    for e in err.errors()[:3]:
        loc = list(e["loc"])
        where = ".".join(str(p) for p in loc)
        if len(loc) >= 2 and isinstance(loc[1], int):
            try:
                name = data[loc[0]][loc[1]].get("name")
                where = f"{loc[0]}[{loc[1]}] ({name})." + ".".join(str(p) for p in loc[2:])
            except (KeyError, IndexError, TypeError, AttributeError):
                pass
        msgs.append(f"{where.rstrip('.')}: {str(e['msg']).removeprefix('Value error, ')}")
    return ClusterFileError(f"{path}: " + "; ".join(msgs))


def _load(p: Path, model: type[M], list_key: str, *other_keys: str) -> M:
    """Read, check the top-level shape, validate; every error names the file and the entry."""
    data = _load_yaml(p)
    keys = (list_key, *other_keys)
    if not isinstance(data, Mapping) or not any(k in data for k in keys):
        lists = " or ".join(f"'{k}'" for k in keys)
        raise ClusterFileError(f"{p}: expected a mapping with a {lists} list")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _explain(p, e, data) from None


def load_cluster(path: Path | str) -> ClusterSpec:
    """The file's nodes, then its racks' trays; errors name the file, the entry and the field."""
    p = Path(path)
    spec = _load(p, ClusterSpec, "nodes", "racks")
    for i, n in enumerate(spec.nodes):
        try:
            topo = n.resolve_topology()
        except UnknownSystemError as e:
            raise ClusterFileError(f"{p}: nodes[{i}] ({n.name}).fixture: {e}") from None
        bad = [g for g in n.gpus_in_use if not 0 <= g < len(topo.gpus)]
        if bad:  # a rack's trays were checked with the rack
            raise ClusterFileError(
                f"{p}: nodes[{i}] ({n.name}).gpusInUse: {bad} out of range for {len(topo.gpus)} GPUs"
            )
    return spec


def load_jobs(path: Path | str) -> JobsSpec:
    return _load(Path(path), JobsSpec, "jobs")


def cluster_states(spec: ClusterSpec, tiers: TierConfig = DEFAULT_TIERS) -> list[NodeState]:
    """Engine node states for a cluster file (stale nodes carry the stale reason)."""
    from gputopo.engine.state.reasons import Reason

    out = []
    for n in spec.nodes:
        topo = n.resolve_topology()
        out.append(
            node_state(
                n.name,
                topo,
                labels=n.labels,
                in_use=frozenset(n.gpus_in_use),
                problem=Reason.TOPOLOGY_STALE if n.stale else None,
                problem_detail="agent heartbeat is older than staleAfterSeconds" if n.stale else "",
                tiers=tiers,
            )
        )
    return out
