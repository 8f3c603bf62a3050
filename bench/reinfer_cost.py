"""What one Job event costs the extender's cache: the pods inferred again, before (every labelled pod of the
namespace) and after (only the pods that name the Job, or its JobSet; `gputopo.extender.state.podindex`).

One namespace holds `--jobsets` JobSets of two Indexed Jobs each (4,096 pods in all by default), one
Indexed Job of 8 pods, and one Job no pod names. Then `--events` spec changes of the unrelated Job and as
many of the 8-pod Job (parallelism toggled, so each event is one inference reads, not a status update).
Prints the CPU milliseconds per event of each path and their ratio; the target (under 5 ms per unrelated
event) is printed, not asserted. No cluster, no I/O: the cache's handlers are called directly.

    .venv/bin/python bench/reinfer_cost.py
    .venv/bin/python bench/reinfer_cost.py --pods 8192 --jobsets 128 --events 50
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from gputopo.extender.watch.cache import ClusterCache
from gputopo.model import SCHEDULER_NAME
from gputopo.model import jobs as J

NS = "train"
TARGET_MS = 5.0


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "labels": labels},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "containers": [{"name": "m", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
        },
        "status": {"phase": "Pending"},
    }


def _job(name: str, pods: int, jobset: str | None = None, gidx: int = 0, parallelism: int | None = None) -> Any:
    labels = (
        {J.JOBSET_NAME: jobset, J.JOBSET_JOB_GLOBAL_INDEX: str(gidx), J.JOBSET_GLOBAL_REPLICAS: "2"} if jobset else {}
    )
    spec = {"completions": pods, "parallelism": pods if parallelism is None else parallelism}
    return {
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {**spec, "completionMode": "Indexed"},
    }


def cluster(pods: int, jobsets: int, *, by_object: bool) -> ClusterCache:
    cache = ClusterCache()
    cache.controllers.by_object = by_object
    per_job = pods // jobsets // 2
    objects, jobs = [], []
    for s in range(jobsets):
        for g in range(2):
            job = f"js{s}-w{g}"
            jobs.append(_job(job, per_job, f"js{s}", g))
            for i in range(per_job):
                labels = {
                    J.JOBSET_NAME: f"js{s}",
                    J.JOB_NAME: job,
                    J.JOBSET_JOB_GLOBAL_INDEX: str(g),
                    J.JOBSET_GLOBAL_REPLICAS: "2",
                    J.JOB_COMPLETION_INDEX: str(i),
                }
                objects.append(_pod(f"{job}-{i}", labels))
    objects += [_pod(f"small-{i}", {J.JOB_NAME: "small", J.JOB_COMPLETION_INDEX: str(i)}) for i in range(8)]
    jobs += [_job("small", 8), _job("unrelated", 4)]
    cache.replace("jobs", jobs)
    cache.replace("pods", objects)
    return cache


def per_event_ms(cache: ClusterCache, name: str, pods: int, events: int) -> float:
    start = time.process_time()
    for e in range(events):
        cache.apply("jobs", "MODIFIED", _job(name, pods, parallelism=pods - e % 2))
    return (time.process_time() - start) * 1000 / events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--pods", type=int, default=4096, help="pods under the JobSets (default 4096)")
    ap.add_argument("--jobsets", type=int, default=64, help="JobSets of two Indexed Jobs each (default 64)")
    ap.add_argument("--events", type=int, default=200, help="Job events per case (default 200)")
    args = ap.parse_args()
    before = cluster(args.pods, args.jobsets, by_object=False)
    after = cluster(args.pods, args.jobsets, by_object=True)
    labelled = sum(1 for r in after.ledger.pods.values() if r.job_keys)
    print(f"{labelled} labelled pods in one namespace, {args.jobsets} JobSets; {args.events} Job events per case")
    print(f"{'event':<28}{'before ms':>12}{'after ms':>12}{'ratio':>10}")
    for what, name, pods in (("an unrelated Job", "unrelated", 4), ("the Job of 8 pods", "small", 8)):
        old = per_event_ms(before, name, pods, args.events)
        new = per_event_ms(after, name, pods, args.events)
        print(f"{what:<28}{old:>12.2f}{new:>12.3f}{old / max(new, 1e-9):>9.0f}x")
        if name == "unrelated":
            verdict = "met" if new < TARGET_MS else "NOT met"
            print(f"  target: under {TARGET_MS} ms per unrelated event: {verdict}")
    same = dict(before.ledger.pods) == dict(after.ledger.pods)
    print(f"records identical after both paths: {same}")


if __name__ == "__main__":
    main()
