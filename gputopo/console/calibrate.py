"""`gputopo calibrate FILE [--system NAME]`: fit the cost model's α (latency) and β (bandwidth) to a
machine's own nccl-tests `all_reduce_perf` output (docs/cost-model.md, "Calibrating").

The model is t(S) = α + 2(n-1)/n · S / B: α the collective's latency, B its bus bandwidth. The fit is
weighted least squares on relative error, so an 8 B row and an 8 GiB row count the same; the error
printed is how far the fitted line is from each measured time.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.engine.network import cost

# nccl-tests' result rows: size, count, type, redop, [root,] then time/algbw/busbw/#wrong out of place
# and in place. Older builds have no root column; `#wrong` is N/A when validation is off (-c 0).
_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"
_ROW = re.compile(r"^\s*[0-9]+\s")
_RANK = re.compile(r"^#\s*Rank\s+([0-9]+)\b")
MAX_INPUT_BYTES = 16 * 1024 * 1024
MAX_ROWS = 4096


class CalibrationError(ValueError):
    """Input that cannot be used; the message names the line."""


@dataclass(frozen=True)
class Row:
    line: int
    size: int  # bytes
    time_us: float  # out-of-place
    algbw: float
    busbw: float
    in_place_time_us: float | None


@dataclass(frozen=True)
class Fit:
    ranks: int
    alpha_us: float
    busbw_gbps: float
    rms_error: float  # relative, 0.1 = 10 %
    max_error: float
    worst_size: int
    rows: int

    def predict_us(self, size: float) -> float:
        return self.alpha_us + _factor(self.ranks) * size / (self.busbw_gbps * 1e3)


def _factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def _float(text: str, line: int, what: str) -> float:
    if not re.fullmatch(_NUMBER, text):
        raise CalibrationError(f"line {line}: {what} {text!r} is not a number")
    return float(text)


def parse(text: str) -> tuple[list[Row], int | None]:
    """Result rows and the rank count (from the '#  Rank N' lines, if present). Lines that are not result
    rows (headers, NCCL INFO logs, blank lines) are skipped; a line that starts like a row but is not one
    is an error naming it."""
    if len(text) > MAX_INPUT_BYTES:
        raise CalibrationError(f"input is larger than {MAX_INPUT_BYTES} bytes; is this an all_reduce_perf output?")
    rows: list[Row] = []
    top_rank: int | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        m = _RANK.match(raw)
        if m:
            top_rank = max(top_rank or 0, int(m.group(1)))
            continue
        if not _ROW.match(raw):
            continue
        f = raw.split()
        if len(f) not in (12, 13):
            raise CalibrationError(
                f"line {number}: expected 12 or 13 columns (size count type redop [root] time algbw busbw #wrong "
                f"time algbw busbw #wrong), found {len(f)}: {raw.strip()[:80]!r}"
            )
        base = len(f) - 8  # index of the out-of-place time
        size = int(f[0])
        if size <= 0:
            raise CalibrationError(f"line {number}: size must be positive")
        t = _float(f[base], number, "time")
        algbw = _float(f[base + 1], number, "algbw")
        busbw = _float(f[base + 2], number, "busbw")
        t_in = _float(f[base + 4], number, "in-place time")
        if t <= 0:
            raise CalibrationError(f"line {number}: time must be positive")
        rows.append(Row(number, size, t, algbw, busbw, t_in if t_in > 0 else None))
        if len(rows) > MAX_ROWS:
            raise CalibrationError(f"line {number}: more than {MAX_ROWS} result rows")
    if not rows:
        raise CalibrationError("no all_reduce_perf result rows found (lines of size, count, type, redop, time, ...)")
    return rows, None if top_rank is None else top_rank + 1


def ranks_of(rows: Sequence[Row], ranks: int | None) -> int:
    """The rank count: from the 'Rank' lines, else from busbw/algbw = 2(n-1)/n on the largest row."""
    if ranks is not None:
        return ranks
    big = max(rows, key=lambda r: r.size)
    if big.algbw <= 0 or big.busbw <= big.algbw * 0.999:
        raise CalibrationError(
            f"line {big.line}: cannot tell the number of ranks (no '#  Rank' lines, and busbw/algbw is not 2(n-1)/n)"
        )
    ratio = big.busbw / big.algbw
    return max(2, round(2 / (2 - ratio))) if ratio < 2 else 2


def fit(rows: Sequence[Row], ranks: int) -> Fit:
    """Weighted least squares of t = α + x·(1/B), x = 2(n-1)/n · S, weights 1/t²."""
    if len({r.size for r in rows}) < 2:
        raise CalibrationError(f"line {rows[0].line}: need results at two or more sizes to fit latency and bandwidth")
    if ranks < 2:
        raise CalibrationError("an all-reduce over one rank moves nothing: run all_reduce_perf over 2 or more GPUs")
    f = _factor(ranks)
    samples = [(f * r.size, r.time_us) for r in rows] + [
        (f * r.size, r.in_place_time_us) for r in rows if r.in_place_time_us is not None
    ]
    sw = sx = sy = sxx = sxy = 0.0
    for x, t in samples:
        w = 1 / (t * t)
        sw += w
        sx += w * x
        sy += w * t
        sxx += w * x * x
        sxy += w * x * t
    det = sw * sxx - sx * sx
    if det <= 0:
        raise CalibrationError("the sizes are too alike to separate latency from bandwidth")
    alpha = (sxx * sy - sx * sxy) / det
    beta = (sw * sxy - sx * sy) / det  # µs per byte
    if alpha < 0:  # latency cannot be negative: refit bandwidth alone through the origin
        alpha, beta = 0.0, sxy / sxx
    if beta <= 0:
        raise CalibrationError("time does not grow with size: these rows cannot give a bandwidth")
    busbw = 1 / beta / 1e3  # bytes/µs -> GB/s
    errors = [(abs(alpha + beta * x - t) / t, x / f) for x, t in samples]
    worst = max(errors)
    rms = math.sqrt(sum(e * e for e, _ in errors) / len(errors))
    return Fit(ranks, alpha, busbw, rms, worst[0], int(worst[1]), len(rows))


@dataclass(frozen=True)
class Setting:
    name: str  # a constant of gputopo.engine.network.cost
    value: float
    why: str


def settings_for(result: Fit, system: str | None) -> list[Setting]:
    """The cost-model constants that make the model reproduce the fit on `system` (a named system of
    `gputopo.systems`), scaled from the constants in force now."""
    steps = 2 * (result.ranks - 1)
    step_s = result.alpha_us * 1e-6 / steps
    if system is None:
        return []
    from gputopo.engine.network.estimate import FALLBACK_NIC_GBIT
    from gputopo.engine.state.snapshot import shape_of
    from gputopo.systems import build_system

    topo = build_system(system)
    shape = shape_of(topo)
    n = result.ranks
    latency_why = f"{result.alpha_us:.1f} us over {steps} ring steps"
    if n <= shape.n:
        bw = cost.intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, range(n))
        scale = result.busbw_gbps / bw.gbps
        why = f"{result.busbw_gbps:.1f} GB/s measured vs {bw.gbps:.1f} GB/s modelled over GPUs 0-{n - 1} ({bw.via})"
        if bw.via == "pcie":
            same = len({shape.numa[i] for i in range(n)}) == 1 and shape.numa[0] is not None
            name = "PCIE_SAME_NUMA_GBPS" if same else "PCIE_CROSS_NUMA_GBPS"
            return [
                Setting(name, round(float(getattr(cost, name)) * scale, 2), why),
                Setting("PCIE_STEP_LATENCY_S", float(f"{step_s:.3g}"), latency_why),
            ]
        return [
            Setting("NVLINK_EFFICIENCY", round(cost.NVLINK_EFFICIENCY * scale, 3), why),
            Setting("NVLINK_STEP_LATENCY_S", float(f"{step_s:.3g}"), latency_why),
        ]
    # More ranks than one node has: a multi-node run, bounded by each node's rail NICs.
    nics = [nic.rate_gbps for nic in topo.nics if nic.active] or [FALLBACK_NIC_GBIT]
    rate = max(nics)
    rails = min(shape.n, sum(1 for r in nics if r == rate))
    modelled = rails * cost.nic_gbps(rate)
    scale = result.busbw_gbps / modelled
    why = f"{result.busbw_gbps:.1f} GB/s measured vs {modelled:.1f} GB/s modelled ({rails}x {rate:.0f} Gb/s NICs)"
    return [
        Setting("NIC_EFFICIENCY", round(cost.NIC_EFFICIENCY * scale, 3), why),
        Setting("NIC_STEP_LATENCY_S", float(f"{step_s:.3g}"), latency_why),
    ]


def domain_setting(result: Fit) -> Setting:
    """A run whose ranks all sat in one multi-node NVLink domain (an NVL72 rack): its bus bandwidth is the
    `nvlink-domain` tier's `busbwGbps`, which the TP-group estimate reads (gputopo.engine.gang.rack)."""
    why = (
        f"{result.busbw_gbps:.1f} GB/s measured over {result.ranks} GPUs of one NVLink domain vs "
        f"{cost.NVLINK_DOMAIN_BUSBW_GBPS:g} GB/s default"
    )
    return Setting("tiers: nvlink-domain busbwGbps", round(result.busbw_gbps, 1), why)


def report(result: Fit, system: str | None, settings: Iterable[Setting]) -> str:
    f = result
    lines = [
        f"all_reduce over {f.ranks} ranks, {f.rows} sizes" + (f", system {system}" if system else ""),
        f"fit: t = {f.alpha_us:.1f} us + 2(n-1)/n * S / {f.busbw_gbps:.1f} GB/s"
        f"  (alpha {f.alpha_us:.1f} us, beta {f.busbw_gbps:.1f} GB/s bus bandwidth)",
        f"fit error: rms {f.rms_error * 100:.1f}%, max {f.max_error * 100:.1f}% (at {cost.format_bytes(f.worst_size)})",
    ]
    settings = list(settings)
    tiers = [s for s in settings if s.name.startswith("tiers: ")]
    settings = [s for s in settings if not s.name.startswith("tiers: ")]
    if tiers:
        lines.append("setting (the chart's tiers value or GPUTOPO_TIERS, tier nvlink-domain):")
        lines += [f"  {s.name.removeprefix('tiers: nvlink-domain ')}: {s.value:g}  # {s.why}" for s in tiers]
    if settings:
        lines.append("settings (constants of gputopo.engine.network.cost):")
        lines += [f"  {s.name} = {s.value:g}  # {s.why}" for s in settings]
    elif not tiers:
        lines.append("settings: pass --system NAME (gputopo simulate's system names) to map the fit onto the constants")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "calibrate", help="fit the cost model's latency and bandwidth to nccl-tests all_reduce_perf output"
    )
    p.add_argument("file", type=Path, help="all_reduce_perf output ('-' for standard input)")
    p.add_argument("--system", default=None, help="the named system it ran on (e.g. hgx-h200), to print settings")
    p.add_argument(
        "--domain",
        action="store_true",
        help="the ranks all sat in one multi-node NVLink domain (an NVL72 rack): print the nvlink-domain "
        "tier's busbwGbps",
    )
    p.set_defaults(_run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from gputopo.systems import UnknownSystemError, build_system

    try:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text(errors="replace")
    except OSError as e:
        sys.stderr.write(f"gputopo calibrate: cannot read {args.file}: {e.strerror or e}\n")
        return 2
    try:
        if args.system is not None:
            build_system(args.system)
        rows, ranks = parse(text)
        result = fit(rows, ranks_of(rows, ranks))
        settings = settings_for(result, args.system)
        if args.domain:
            settings.append(domain_setting(result))
    except UnknownSystemError as e:
        sys.stderr.write(f"gputopo calibrate: {e}\n")
        return 2
    except CalibrationError as e:
        sys.stderr.write(f"gputopo calibrate: {args.file}: {e}\n")
        return 1
    sys.stdout.write(report(result, args.system, settings) + "\n")
    return 0
