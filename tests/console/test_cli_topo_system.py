"""`gputopo topo --system NAME`: a named system or rack as gputopo builds it, without a cluster."""

from __future__ import annotations

import pytest

from gputopo.console.cli import main
from gputopo.systems import rack_clique


def _topo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["topo", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    ("rack", "tray", "mib"), [("gb200-nvl72", "gb200-tray", 189471), ("gb300-nvl72", "gb300-tray", 287775)]
)
def test_a_named_rack_prints_its_tray_topology_and_one_line_per_tray_in_one_domain(
    capsys: pytest.CaptureFixture[str], rack: str, tray: str, mib: int
) -> None:
    rc, out, err = _topo(capsys, "--system", rack)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"Rack {rack}: 18 trays ({tray}), one NVLink domain of 72 GPUs"
    assert f"GPU0: NVIDIA {tray[:5].upper()}, {mib} MiB" in out
    rows = [ln.split() for ln in lines if ln.startswith(f"{rack}-tray-")]
    assert [r[0] for r in rows] == [f"{rack}-tray-{i:02d}" for i in range(1, 19)]
    assert all(r[1:] == ["4", rack_clique(rack), "healthy"] for r in rows)


def test_a_named_tray_prints_like_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _topo(capsys, "--system", "gb300-tray")
    assert rc == 0
    assert out.startswith("System gb300-tray\n")
    assert "NIC0: mlx5_0 (InfiniBand, 800 Gb/s" in out and "NVLink: generation 5, 50 GB/s per link, via NVSwitch" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--system", "gb100-nvl36"], "unknown system 'gb100-nvl36'; known: ", id="unknown"),
        pytest.param([], "give either NODE or --system NAME", id="neither"),
        pytest.param(["n1", "--system", "gb200-tray"], "give either NODE or --system NAME", id="both"),
    ],
)
def test_bad_topo_arguments_give_one_error_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc, out, err = _topo(capsys, *args)
    assert (rc, out) == (2, "")
    assert len(err.strip().splitlines()) == 1 and message in err


def test_the_unknown_system_error_lists_systems_and_racks(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, err = _topo(capsys, "--system", "x")
    assert "gb200-nvl72" in err and "gb300-nvl72" in err and "dgx-h100" in err and "gb300-tray" in err
