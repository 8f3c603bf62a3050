"""`gputopo simulate`: place a job list on a cluster file under a policy and show what happened."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gputopo.clusterfile import ClusterFileError, cluster_states, load_cluster, load_jobs
from gputopo.sim.core import POLICIES, JobInputError, simulate
from gputopo.sim.output import render_json, render_text
from gputopo.tiers import DEFAULT_TIERS

NAME = "simulate"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        NAME,
        help="place a job list on a simulated cluster and explain every decision",
        description=(
            "Place the jobs of JOBS, in order, on the cluster of CLUSTER (both YAML; see examples/) and print "
            "where every pod went and why, the pods that could not be placed with kube-scheduler's reasons, "
            "and summary figures of placement quality."
        ),
    )
    p.add_argument(
        "--cluster", required=True, metavar="FILE", help="cluster.yaml: nodes (fixture or topology) and racks"
    )
    p.add_argument("--jobs", required=True, metavar="FILE", help="jobs.yaml: jobs placed in order")
    p.add_argument("--output", choices=("text", "json"), default="text", help="output format (default: text)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="gputopo",
        help="gputopo (default), default (what Kubernetes does today) or random",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for random choices and kube-scheduler's tie-breaks")
    return p


def _one_line(text: str) -> str:
    """PyYAML's messages span several lines (with a caret drawing); one line reads better in a terminal."""
    return " ".join(text.split())


def run(args: argparse.Namespace) -> int:
    try:
        spec = load_cluster(args.cluster)
        jobs = load_jobs(args.jobs)
        nodes = cluster_states(spec, DEFAULT_TIERS)
        result = simulate(nodes, jobs.jobs, args.policy, DEFAULT_TIERS, args.seed)
    except ClusterFileError as e:
        sys.stderr.write(f"gputopo simulate: {_one_line(str(e))}\n")
        return 2
    except JobInputError as e:
        sys.stderr.write(f"gputopo simulate: {args.jobs}: {_one_line(str(e))}\n")
        return 2
    text = render_json(result) + "\n" if args.output == "json" else render_text(result)
    sys.stdout.write(text)
    return 0
