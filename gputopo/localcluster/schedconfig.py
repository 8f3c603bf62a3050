"""The KubeSchedulerConfiguration of a local kube-scheduler, with its optional extender entry."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.model import GPU_RESOURCE


@dataclass(frozen=True)
class ExtenderConfig:
    """One ``extenders[]`` entry of a KubeSchedulerConfiguration (upstream field names in comments)."""

    url: str  # urlPrefix
    filter_verb: str | None = "filter"
    prioritize_verb: str | None = "prioritize"
    bind_verb: str | None = "bind"
    preempt_verb: str | None = None  # "preempt": clique-aware victims (docs/extender.md, "Preemption")
    weight: int = 5
    node_cache_capable: bool = True
    http_timeout: str = "5s"
    ignorable: bool = False
    # (name, ignoredByScheduler)
    managed_resources: tuple[tuple[str, bool], ...] = ((GPU_RESOURCE, False),)
    ca_file: Path | None = None  # tlsConfig.caFile: verify the extender's serving certificate

    def to_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "urlPrefix": self.url,
            "weight": self.weight,
            "nodeCacheCapable": self.node_cache_capable,
            "enableHTTPS": self.url.startswith("https://"),
            "httpTimeout": self.http_timeout,
            "ignorable": self.ignorable,
            "managedResources": [{"name": n, "ignoredByScheduler": ignored} for n, ignored in self.managed_resources],
        }
        if self.ca_file is not None:
            out["tlsConfig"] = {"caFile": str(self.ca_file)}
        for key, verb in (
            ("filterVerb", self.filter_verb),
            ("prioritizeVerb", self.prioritize_verb),
            ("bindVerb", self.bind_verb),
            ("preemptVerb", self.preempt_verb),
        ):
            if verb:
                out[key] = verb
        return out


@dataclass(frozen=True, kw_only=True)
class SchedulerOptions:
    """A local kube-scheduler's options: the share of nodes it scores, whether its DefaultPreemption
    is off, its API client's QPS and burst, and its parallelism (None: kube-scheduler's default)."""

    percentage_of_nodes_to_score: int = 100
    disable_preemption: bool = True
    client_qps: float = 50.0
    client_burst: int = 100
    parallelism: int | None = None


LOCAL_SCHEDULER = SchedulerOptions()


def scheduler_configuration(
    kubeconfig: Path, profile: str, extender: ExtenderConfig | None = None, options: SchedulerOptions = LOCAL_SCHEDULER
) -> dict[str, Any]:
    """The KubeSchedulerConfiguration (as a dict) for a scheduler with exactly one profile."""
    prof: dict[str, Any] = {"schedulerName": profile}
    if options.disable_preemption:
        prof["plugins"] = {"postFilter": {"disabled": [{"name": "DefaultPreemption"}]}}
    cfg: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": options.client_qps, "burst": options.client_burst},
        "leaderElection": {"leaderElect": False},
        "percentageOfNodesToScore": options.percentage_of_nodes_to_score,
        "profiles": [prof],
    }
    if options.parallelism is not None:
        cfg["parallelism"] = options.parallelism
    if extender is not None:
        cfg["extenders"] = [extender.to_config()]
    return cfg
