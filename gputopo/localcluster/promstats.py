"""Latency histograms scraped from the local components' Prometheus /metrics pages.

kube-scheduler's attempt, algorithm and Bind latencies and the extender's own per-verb request
durations, summed over label values and diffed between two scrapes so a measurement sees only what
happened during it. The components serve self-signed certificates on loopback, so the scrape does
not verify them.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gputopo.localcluster.controlplane import ControlPlane

# What a run reports from kube-scheduler's /metrics: a title, the histogram, the labels it must have.
SCHED_METRICS = {
    "attempt (scheduled)": ("scheduler_scheduling_attempt_duration_seconds", {"result": "scheduled"}),
    "algorithm (filter+score)": ("scheduler_scheduling_algorithm_duration_seconds", {}),
    "extension point Bind": ("scheduler_framework_extension_point_duration_seconds", {"extension_point": "Bind"}),
}


def _insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def http_get(url: str, *, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered. Never raises: a missing page is a gap
    in the figures, not a failed measurement."""
    ctx = _insecure() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""
    except OSError:
        return 0, ""


@dataclass
class HistSum:
    """One histogram's count, sum and cumulative buckets (upper bound in seconds -> count)."""

    count: float = 0.0
    total: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def minus(self, before: HistSum) -> HistSum:
        return HistSum(
            self.count - before.count,
            self.total - before.total,
            {le: v - before.buckets.get(le, 0.0) for le, v in self.buckets.items()},
        )

    @property
    def mean_ms(self) -> float:
        return 1000.0 * self.total / self.count if self.count else float("nan")

    def quantile_ms(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (what a histogram can tell)."""
        if not self.count:
            return float("nan")
        want = q * self.count
        for le in sorted(self.buckets):
            if self.buckets[le] >= want:
                return 1000.0 * le
        return float("inf")


def histograms(text: str, name: str, label: str, match: dict[str, str] | None = None) -> dict[str, HistSum]:
    """Histogram `name` from a Prometheus text page, summed per value of `label`."""
    out: dict[str, HistSum] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if match and any(s.labels.get(k) != v for k, v in match.items()):
                continue
            h = out.setdefault(s.labels.get(label, ""), HistSum())
            if s.name == name + "_count":
                h.count += s.value
            elif s.name == name + "_sum":
                h.total += s.value
            elif s.name == name + "_bucket":
                le = float(s.labels["le"])
                h.buckets[le] = h.buckets.get(le, 0.0) + s.value
    return out


def scheduler_metrics(cp: ControlPlane, name: str) -> dict[str, HistSum]:
    """The `SCHED_METRICS` histograms of scheduler `name` so far ({} when its page does not answer)."""
    status, text = http_get(f"https://127.0.0.1:{cp.scheduler_port(name)}/metrics")
    if status != 200:
        return {}
    out: dict[str, HistSum] = {}
    for title, (metric, match) in SCHED_METRICS.items():
        h = HistSum()
        for part in histograms(text, metric, "__none__", match).values():
            h.count += part.count
            h.total += part.total
            for le, v in part.buckets.items():
                h.buckets[le] = h.buckets.get(le, 0.0) + v
        out[title] = h
    return out


def extender_metrics(metrics_url: str) -> dict[str, HistSum]:
    """The extender's request durations so far, per verb, from its /metrics page at `metrics_url`
    ({} when the page does not answer)."""
    status, text = http_get(metrics_url)
    if status != 200:
        return {}
    return histograms(text, "gputopo_extender_request_duration_seconds", "verb")


def diff(after: dict[str, HistSum], before: dict[str, HistSum]) -> dict[str, HistSum]:
    """What was recorded between two scrapes."""
    return {k: v.minus(before[k]) if k in before else v for k, v in after.items()}
