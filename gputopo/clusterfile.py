"""`cluster.yaml` and `jobs.yaml` (docs/simulator.md, "Files"): the simulator's input and the
extender's `--snapshot` source. Errors name the file, the entry and the field."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gputopo.engine.snapshot import NodeState, node_state
from gputopo.model import ANN_GROUP, ANN_GROUP_SIZE, ANN_STAGE, NodeTopology
from gputopo.systems import UnknownSystemError, build_system
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


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: list[NodeSpec]

    @model_validator(mode="after")
    def _unique(self) -> ClusterSpec:
        seen: set[str] = set()
        for n in self.nodes:
            if n.name in seen:
                raise ValueError(f"node name {n.name!r} appears twice")
            seen.add(n.name)
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


def _explain(path: Path, err: ValidationError, data: Any, list_key: str) -> ClusterFileError:
    msgs = []
    for e in err.errors()[:3]:
        loc = list(e["loc"])
        where = ".".join(str(p) for p in loc)
        if len(loc) >= 2 and loc[0] == list_key and isinstance(loc[1], int):
            try:
                name = data[list_key][loc[1]].get("name")
                where = f"{list_key}[{loc[1]}] ({name})." + ".".join(str(p) for p in loc[2:])
            except (KeyError, IndexError, TypeError, AttributeError):
                pass
        msgs.append(f"{where.rstrip('.')}: {str(e['msg']).removeprefix('Value error, ')}")
    return ClusterFileError(f"{path}: " + "; ".join(msgs))


def _load(p: Path, model: type[M], list_key: str) -> M:
    """Read, check the top-level shape, validate; every error names the file and the entry."""
    data = _load_yaml(p)
    if not isinstance(data, Mapping) or list_key not in data:
        raise ClusterFileError(f"{p}: expected a mapping with a '{list_key}' list")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _explain(p, e, data, list_key) from None


def load_cluster(path: Path | str) -> ClusterSpec:
    p = Path(path)
    spec = _load(p, ClusterSpec, "nodes")
    for i, n in enumerate(spec.nodes):
        try:
            topo = n.resolve_topology()
        except UnknownSystemError as e:
            raise ClusterFileError(f"{p}: nodes[{i}] ({n.name}).fixture: {e}") from None
        bad = [g for g in n.gpus_in_use if not 0 <= g < len(topo.gpus)]
        if bad:
            raise ClusterFileError(
                f"{p}: nodes[{i}] ({n.name}).gpusInUse: {bad} out of range for {len(topo.gpus)} GPUs"
            )
    return spec


def load_jobs(path: Path | str) -> JobsSpec:
    return _load(Path(path), JobsSpec, "jobs")


def cluster_states(spec: ClusterSpec, tiers: TierConfig = DEFAULT_TIERS) -> list[NodeState]:
    """Engine node states for a cluster file (stale nodes carry the stale reason)."""
    from gputopo.engine.reasons import Reason

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
