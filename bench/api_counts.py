"""Per-pod cost figures for `scheduler_throughput.py`: API calls, extender bytes, CPU per scheduled pod.

- API calls: kube-apiserver's own `apiserver_request_total` (by verb, resource and subresource; watches
  and the benchmark's own calls included, the same way in every run), scraped before and after a run
  with the admin token and diffed.
- Extender bytes: the extender's `gputopo_extender_wire_bytes_total` (request and answer bodies, by verb).
- CPU: the per-process CPU seconds a run recorded, divided by the pods it bound.

Imported by the script from its own folder.
"""

from __future__ import annotations

import ssl
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from gputopo.localcluster import ControlPlane
from gputopo.localcluster.promstats import http_get

# Calls the runs make for setup or measurement only (lists and watches of the benchmark itself are
# counted too, alike in both runs); LIST/WATCH are shown, since the extender's informers add watches.
SHOWN_VERBS = ("POST", "PATCH", "PUT", "DELETE", "GET", "LIST", "WATCH")


def apiserver_calls(cp: ControlPlane) -> dict[str, float]:
    """kube-apiserver's request counts so far, keyed `VERB resource[/subresource]` (empty on failure)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # loopback, self-signed: the same as the other scrapes
    req = urllib.request.Request(f"{cp.server}/metrics", headers={"Authorization": f"Bearer {cp.admin_token}"})
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            text = resp.read().decode()
    except OSError:
        return out
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            verb = s.labels.get("verb", "")
            resource = s.labels.get("resource", "") or s.labels.get("component", "")
            sub = s.labels.get("subresource", "")
            key = f"{verb} {resource}{'/' + sub if sub else ''}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def extender_bytes(metrics_url: str) -> dict[tuple[str, str], float]:
    """(verb, in|out) -> bytes so far, and ("prioritize", "ahead") -> prioritize calls answered with the
    answer computed ahead, from the extender's /metrics ({} when it does not answer)."""
    status, text = http_get(metrics_url)
    if status != 200:
        return {}
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            if family.name == "gputopo_extender_wire_bytes":
                out[(s.labels["verb"], s.labels["direction"])] = s.value
            elif family.name == "gputopo_extender_decisions" and s.labels.get("reason") == "ahead":
                out[("prioritize", "ahead")] = out.get(("prioritize", "ahead"), 0.0) + s.value
    return out


def calls_table(runs: list[tuple[str, dict[str, float], int]]) -> list[str]:
    """API calls per bound pod, one column per run: (label, calls during the run, pods bound)."""
    keys = sorted(
        {k for _, c, _ in runs for k, v in c.items() if v > 0 and k.split()[0] in SHOWN_VERBS},
        key=lambda k: (-max(c.get(k, 0) / max(p, 1) for _, c, p in runs), k),
    )
    lines = ["  " + f"{'call':<34}" + "".join(f" {label:>26}" for label, _, _ in runs)]
    for k in keys:
        lines.append("  " + f"{k:<34}" + "".join(f" {c.get(k, 0) / max(p, 1):>26.2f}" for _, c, p in runs))
    writes = [sum(v for k, v in c.items() if k.split()[0] in ("POST", "PATCH", "PUT")) / max(p, 1) for _, c, p in runs]
    lines.append("  " + f"{'writes (POST+PATCH+PUT)':<34}" + "".join(f" {w:>26.2f}" for w in writes))
    lines.append("  " + f"{'all calls':<34}" + "".join(f" {sum(c.values()) / max(p, 1):>26.2f}" for _, c, p in runs))
    return lines


def bytes_lines(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], calls: dict[str, float]
) -> list[str]:
    """Mean request and answer bytes per extender call, by verb, between two scrapes."""
    lines = []
    for verb in ("filter", "prioritize", "bind"):
        n = calls.get(verb, 0.0)
        if not n:
            continue
        got = [(after.get((verb, d), 0.0) - before.get((verb, d), 0.0)) / n for d in ("in", "out")]
        lines.append(
            f"  {verb:<12} {n:>6.0f} calls  {got[0] / 1024:>8.1f} KiB in  {got[1] / 1024:>8.1f} KiB out per call"
        )
    n = calls.get("prioritize", 0.0)
    if n:
        ahead = after.get(("prioritize", "ahead"), 0.0) - before.get(("prioritize", "ahead"), 0.0)
        lines.append(
            f"  prioritize answered ahead (computed while kube-scheduler ran its score plugins): {ahead:.0f} of {n:.0f}"
        )
    return lines


def cpu_per_pod_lines(runs: list[tuple[str, dict[str, float], int]]) -> list[str]:
    """CPU ms per bound pod, summed over every process, one figure per run, and the ratio to the first."""
    totals = [sum(cpu.values()) * 1000 / max(pods, 1) for _, cpu, pods in runs]
    lines = []
    for (label, cpu, pods), total in zip(runs, totals, strict=True):
        parts = ", ".join(f"{k} {v * 1000 / max(pods, 1):.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
        ratio = f"  ({total / totals[0]:.2f}x the first run)" if totals[0] else ""
        lines.append(f"  {label:<34} {total:>6.1f} ms per pod{ratio}: {parts}")
    return lines


def between(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What a counter snapshot gained between two scrapes."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


# kube-scheduler v1.34 has no metric of its own for extender calls (its binary names none): they run
# inside scheduling_algorithm_duration_seconds (filter, prioritize), and an extender's bind is not the
# Bind extension point (framework_extension_point_duration_seconds{extension_point="Bind"} stays 0).
SCHEDULER_VIEW = (
    "  kube-scheduler's own view: no extender metric exists in v1.34; filter and prioritize calls run inside\n"
    "  'algorithm (filter+score)' above (gputopo minus plain = the extender calls as kube-scheduler waits on them),\n"
    "  and the extender's bind is outside the Bind extension point (its count stays 0)."
)
