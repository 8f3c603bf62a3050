"""The simulator behind `gputopo simulate`: replay a job list against a cluster under a placement policy.

Pure apart from file loading in `gputopo.sim.cli`: the same inputs and seed always give the same result.
"""

from gputopo.sim.core import POLICIES, EngineSetup, JobInputError, SimResult, prepare_pods, simulate
from gputopo.sim.metrics import Summary
from gputopo.sim.records import Measures, PodPlacement, SimPod, UnplacedPod

__all__ = [
    "POLICIES",
    "EngineSetup",
    "JobInputError",
    "Measures",
    "PodPlacement",
    "SimPod",
    "SimResult",
    "Summary",
    "UnplacedPod",
    "prepare_pods",
    "simulate",
]
