"""`gputopo calibrate`: reading nccl-tests all_reduce_perf output and fitting latency and bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.console.calibrate import CalibrationError, fit, parse, ranks_of, settings_for
from gputopo.console.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
H200 = FIXTURES / "all_reduce_h200_8gpu.txt"  # 13 columns, Rank lines, NCCL INFO lines between rows
PAIR = FIXTURES / "all_reduce_a100_bridged_pair.txt"  # older 12 columns (no root), #wrong N/A, no Rank lines

# The standard table's column header and two result rows, aligned as all_reduce_perf prints them.
HEADER = (
    "#       size         count      type   redop    root"
    "     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
)
ROW_1M = (
    "     1048576        262144     float     sum      -1"
    "    33.12   31.66   55.41      0    33.02   31.76   55.57      0\n"
)
ROW_16M = (
    "    16777216       4194304     float     sum      -1"
    "    91.40  183.56  321.23      0    90.95  184.47  322.82      0\n"
)


@pytest.mark.parametrize(
    ("path", "rows", "ranks", "alpha_us", "busbw"),
    [
        pytest.param(H200, 16, 8, 28.0, 470.0, id="h200-8-gpus-13-columns"),
        pytest.param(PAIR, 6, 2, 12.0, 205.0, id="bridged-pair-12-columns-ranks-from-busbw"),
    ],
)
def test_fit_recovers_latency_and_bandwidth(path: Path, rows: int, ranks: int, alpha_us: float, busbw: float) -> None:
    parsed, from_lines = parse(path.read_text())
    assert len(parsed) == rows
    result = fit(parsed, ranks_of(parsed, from_lines))
    assert result.ranks == ranks
    # The fixtures were drawn from t = alpha + 2(n-1)/n * S / busbw with +-3% noise.
    assert result.alpha_us == pytest.approx(alpha_us, rel=0.05)
    assert result.busbw_gbps == pytest.approx(busbw, rel=0.02)
    assert result.rms_error < 0.03 and result.max_error < 0.06


def test_fit_of_a_pure_alpha_beta_table_is_exact() -> None:
    rows = []
    for size in (1 << 10, 1 << 20, 1 << 30):
        t = 20.0 + 2 * 7 / 8 * size / (400.0 * 1e3)  # 20 us + 2(n-1)/n * S / 400 GB/s, n = 8
        rows.append(f"{size} {size // 4} float sum -1 {t:.4f} 1 1 0 {t:.4f} 1 1 0")
    parsed, _ = parse("\n".join(rows))
    result = fit(parsed, 8)
    assert result.alpha_us == pytest.approx(20.0, rel=1e-3)
    assert result.busbw_gbps == pytest.approx(400.0, rel=1e-3)
    assert result.max_error < 1e-3


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(
            HEADER + ROW_1M + "     2097152   524288   float  sum  -1  40.0\n",
            "line 3: expected 12 or 13",
            id="short-row",
        ),
        pytest.param(HEADER + ROW_1M.replace("33.12", "n/a"), "line 2: time 'n/a' is not a number", id="bad-time"),
        pytest.param(HEADER + ROW_1M.replace("33.12", "0.00"), "line 2: time must be positive", id="zero-time"),
        pytest.param(HEADER + "gpu49:1:1 [0] NCCL WARN Cuda failure\n", "no all_reduce_perf result rows", id="no-rows"),
        pytest.param("", "no all_reduce_perf result rows", id="empty"),
        pytest.param(HEADER + ROW_1M + ROW_1M, "line 2: need results at two or more sizes", id="one-size"),
    ],
)
def test_bad_input_names_the_line(text: str, words: str) -> None:
    with pytest.raises(CalibrationError, match=words):
        parsed, ranks = parse(text)
        fit(parsed, ranks_of(parsed, ranks) if ranks is None else ranks)


def test_garbage_between_rows_is_skipped() -> None:
    text = (
        "NCCL version 2.21.5\nhost:1:2 [0] NCCL INFO Channel 00\n"
        + HEADER
        + ROW_1M
        + "\n\t\n"
        + ROW_16M
        + "# Avg bus bandwidth : 1\n"
    )
    parsed, ranks = parse(text)
    assert [r.line for r in parsed] == [4, 7]
    assert ranks is None
    assert ranks_of(parsed, ranks) == 8  # busbw/algbw = 1.75 = 2(n-1)/n


@pytest.mark.parametrize(
    ("system", "ranks", "names"),
    [
        pytest.param("hgx-h200", 8, ["NVLINK_EFFICIENCY", "NVLINK_STEP_LATENCY_S"], id="nvswitch-node"),
        pytest.param("l40s-4", 4, ["PCIE_CROSS_NUMA_GBPS", "PCIE_STEP_LATENCY_S"], id="pcie-across-sockets"),
        pytest.param("hgx-h200", 16, ["NIC_EFFICIENCY", "NIC_STEP_LATENCY_S"], id="two-nodes-over-the-nics"),
        pytest.param(None, 8, [], id="no-system-no-settings"),
    ],
)
def test_settings_name_the_constants_for_the_system(system: str | None, ranks: int, names: list[str]) -> None:
    parsed, _ = parse(H200.read_text())
    assert [s.name for s in settings_for(fit(parsed, ranks), system)] == names


def test_nvswitch_setting_scales_the_efficiency_to_the_measured_bandwidth() -> None:
    parsed, ranks = parse(H200.read_text())
    result = fit(parsed, ranks_of(parsed, ranks))
    eff, latency = settings_for(result, "hgx-h200")
    assert eff.value == pytest.approx(0.82 * result.busbw_gbps / 369.0, abs=1e-3)
    assert latency.value == pytest.approx(result.alpha_us * 1e-6 / 14, rel=1e-2)


def test_cli_prints_fit_error_and_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", str(H200), "--system", "hgx-h200"]) == 0
    out = capsys.readouterr().out
    assert "all_reduce over 8 ranks, 16 sizes, system hgx-h200" in out
    assert "fit error: rms" in out
    assert "NVLINK_EFFICIENCY = " in out


@pytest.mark.parametrize(
    ("args", "status", "words"),
    [
        pytest.param(["--system", "dgx-9000"], 2, "unknown system 'dgx-9000'", id="unknown-system"),
        pytest.param([], 1, "line 2: time 'n/a' is not a number", id="bad-row"),
    ],
)
def test_cli_errors_go_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], status: int, words: str
) -> None:
    bad = tmp_path / "out.txt"
    bad.write_text(HEADER + ROW_1M.replace("33.12", "n/a"))
    assert main(["calibrate", str(bad), *args]) == status
    assert words in capsys.readouterr().err


def test_cli_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["calibrate", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_domain_prints_the_nvlink_domain_tiers_bus_bandwidth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An NVL72 rack's 72 ranks, drawn exactly from t = 40 us + 2(n-1)/n * S / 800 GB/s.
    rows = [f"# Rank {r} Group 0 Pid 1 on tray device {r % 4} [0x01] NVIDIA GB200" for r in range(72)]
    for size in (1 << 20, 1 << 24, 1 << 28, 1 << 30, 1 << 32):
        t = 40.0 + 2 * 71 / 72 * size / (800.0 * 1e3)
        rows.append(f"{size} {size // 4} float sum -1 {t:.4f} 1 1 0 {t:.4f} 1 1 0")
    path = tmp_path / "rack.txt"
    path.write_text("\n".join(rows) + "\n")
    assert main(["calibrate", str(path), "--domain"]) == 0
    out = capsys.readouterr().out
    assert "all_reduce over 72 ranks" in out
    assert "tier nvlink-domain" in out
    assert "busbwGbps: 800  # 800.0 GB/s measured over 72 GPUs of one NVLink domain vs 745 GB/s default" in out
