"""The unmodified NVML adapter through nvidia-ml-py and a real libnvidia-ml.so.1 (the mock built here).

Every named system is rebuilt from the library's answers; faults are written into the profile under a
running adapter, published within one discovery, and the recovery is published too; a GPU that cannot
be read (lost, off the bus, a reading out of range, a name that does not decode) changes nothing of
what is published about the others; functions an older driver lacks (an error code or a missing
symbol) take the adapter's fallbacks; a malformed profile is refused with the line that is wrong.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.labels import node_labels
from gputopo.agent.nvml_backend import NvmlAdapter, NvmlUnavailableError
from gputopo.agent.nvml_health import HEALTH_HOLD_SECONDS
from gputopo.agent.nvml_xid import RECENT_PER_GPU, XID_QUIET_SECONDS
from gputopo.localcluster.nvmlmock import (
    PROFILE_ENV,
    LibraryBuildError,
    Profile,
    build_library,
    profile_for_system,
    write_profile,
)
from gputopo.localcluster.nvmlmock.profile import SYSTEM_WIRING
from gputopo.model import (
    LABEL_NVLINK_FABRIC,
    DegradedLink,
    FabricHealth,
    FabricState,
    Health,
    LinkState,
    NodeTopology,
    decode_health,
    parse_topology,
)
from gputopo.systems import SYSTEMS, VARIANTS, build_system
from tests.agent.libnvml_harness import Node

GPU_IS_LOST = 15
UNKNOWN_ERROR = 999
INSUFFICIENT_RESOURCES = 23
P2P_NOT_SUPPORTED = 5


def expected(system: str) -> NodeTopology:
    return build_system(system).model_copy(update={"nics": ()})


def discover(node: Node, seconds: float = 10.0) -> NodeTopology:
    node.clock.now += seconds
    return node.adapter.discover().topology


# --------------------------------------------------------------------------------------------------
# Whole systems


@pytest.mark.parametrize(
    "system",
    [
        pytest.param("dgx-1v", id="libnvml dgx-1v: direct NVLink 2 hybrid cube mesh, NV1/NV2"),
        pytest.param("dgx-a100", id="libnvml dgx-a100: six NVSwitches, NV12 every pair"),
        pytest.param("dgx-h100", id="libnvml dgx-h100: four NVSwitches, NV18, board fabric with zero UUID"),
        pytest.param("hgx-h200", id="libnvml hgx-h200: NV18 through NVSwitch"),
        pytest.param("hgx-a100-4", id="libnvml hgx-a100-4: direct mesh NV4"),
        pytest.param("a100-pcie-bridged", id="libnvml a100 PCIe NV12 bridge pairs"),
        pytest.param("a100-pcie-bridged-nonadjacent", id="libnvml bridge pairs on non-adjacent indices"),
        pytest.param("l40s-4", id="libnvml l40s: NVLink NotSupported, PCIe only"),
        pytest.param("rtx4090-8", id="libnvml rtx4090: no NVLink"),
        pytest.param("gb200-tray", id="libnvml gb200 tray: fabric v2 struct, clique from cluster UUID and id"),
        pytest.param("gb200-tray-degraded", id="libnvml gb200 tray with healthMask 0xa9 on GPU 2"),
        pytest.param("gb300-tray", id="libnvml gb300 tray"),
    ],
)
def test_libnvml_adapter_rebuilds_each_named_system(system: str, libnvml_node: Node) -> None:
    libnvml_node.write(profile_for_system(system))
    got = discover(libnvml_node)
    assert got.nvlink.links == expected(system).nvlink.links
    assert got == expected(system)


def test_libnvml_profiles_cover_every_named_system() -> None:
    assert set(SYSTEM_WIRING) == set(SYSTEMS) | set(VARIANTS)


# --------------------------------------------------------------------------------------------------
# Faults under a running adapter, and recovery


def _link_down(p: Profile) -> None:
    assert p.gpus[3].links is not None
    p.gpus[3].links[5].active = False


def _replay_errors(p: Profile) -> None:
    assert p.gpus[0].links is not None
    p.gpus[0].links[0].counters[0] = 5


def _p2p_lost(p: Profile) -> None:
    p.gpus[2].p2p[5] = P2P_NOT_SUPPORTED
    p.gpus[5].p2p[2] = P2P_NOT_SUPPORTED


def _fabric(**changes: int) -> Callable[[Profile], None]:
    def apply(p: Profile) -> None:
        fabric = p.gpus[1].fabric
        assert fabric is not None
        for k, v in changes.items():
            setattr(fabric, k, v)

    return apply


def _fail(gpu: int, function: str, code: int = GPU_IS_LOST) -> Callable[[Profile], None]:
    return lambda p: p.gpus[gpu].fails.update({function: code})


def _remapped(gpu: int, rows: tuple[int, int, int, int]) -> Callable[[Profile], None]:
    def apply(p: Profile) -> None:
        p.gpus[gpu].remapped = rows

    return apply


# (system, fault, the faulted GPU, its health, its reason, the degraded links)
FAULTS = [
    pytest.param("dgx-h100", _link_down, 3, Health.DEGRADED, "NVLink link 5 down",
                 (DegradedLink(gpu=3, link=5, state=LinkState.DOWN, detail="link not active"),),
                 id="libnvml link down: GPU 3 degraded, link 5 named"),
    pytest.param("dgx-1v", _replay_errors, 0, Health.DEGRADED, "NVLink link 0 degraded: 5 replay errors in 10 s",
                 (DegradedLink(gpu=0, link=0, state=LinkState.DEGRADED, detail="5 replay errors in 10 s"),),
                 id="libnvml replay counter rising: the link degraded with the count"),
    pytest.param("dgx-h100", _p2p_lost, 2, Health.DEGRADED,
                 "NVLink peer-to-peer to GPU 5 not working although its links are Active "
                 "(NVML P2P status: not supported)", (),
                 id="libnvml P2P over NVLink lost, links still Active: both GPUs degraded, the peer named"),
    pytest.param("gb200-tray", _fabric(health_mask=0xA9), 1, Health.DEGRADED,
                 "NVLink fabric degraded: healthMask 0xa9: degraded bandwidth", (),
                 id="libnvml fabric health mask degraded bandwidth"),
    pytest.param("gb200-tray", _fabric(status=INSUFFICIENT_RESOURCES), 1, Health.DEGRADED,
                 "NVLink fabric registration failed: Insufficient Resources (NVML status 23)", (),
                 id="libnvml fabric status Insufficient Resources: degraded in the library's words"),
    pytest.param("gb200-tray", _fabric(state=2), 1, Health.OK, None, (),
                 id="libnvml fabric state back to in-progress: published, the tray unknown"),
    pytest.param("dgx-1v", _fail(2, "nvmlDeviceGetMemoryInfo"), 2, Health.FAILED,
                 "NVML error: GPU is lost (NVMLError_GpuIsLost)", (),
                 id="libnvml GPU lost mid-reading: failed, no work"),
    pytest.param("dgx-a100", _fail(6, "*"), 6, Health.FAILED, "NVML error: GPU is lost (NVMLError_GpuIsLost)", (),
                 id="libnvml GPU fallen off the bus (no handle): failed, its UUID and bus kept"),
    pytest.param("dgx-a100", _remapped(4, (0, 0, 1, 0)), 4, Health.DEGRADED,
                 "HBM row remapping pending: the GPU needs a reset", (), id="libnvml remapped rows pending"),
    pytest.param("dgx-a100", _remapped(4, (0, 3, 0, 1)), 4, Health.FAILED,
                 "HBM row remapping failed: replace the GPU (RMA candidate)", (), id="libnvml row remapping failed"),
]  # fmt: skip


@pytest.mark.parametrize(("system", "fault", "gpu", "health", "reason", "degraded"), FAULTS)
def test_libnvml_fault_under_a_running_adapter_is_published_then_its_recovery(
    system: str,
    fault: Callable[[Profile], None],
    gpu: int,
    health: Health,
    reason: str | None,
    degraded: tuple[DegradedLink, ...],
    libnvml_node: Node,
) -> None:
    healthy = profile_for_system(system)
    libnvml_node.write(healthy)
    assert discover(libnvml_node) == expected(system)

    broken = profile_for_system(system)
    fault(broken)
    libnvml_node.write(broken)
    got = discover(libnvml_node)
    assert got.gpus[gpu].health is health
    assert (reason in got.gpus[gpu].reasons) if reason else got.gpus[gpu].reasons == ()
    assert got.degraded_links == degraded
    # The faulted GPU keeps its identity, so the device plugin's device and the peers' links stay its.
    assert (got.gpus[gpu].uuid, got.gpus[gpu].pci_bus_id) == (
        expected(system).gpus[gpu].uuid,
        expected(system).gpus[gpu].pci_bus_id,
    )
    if fault is _p2p_lost:
        assert got.gpus[5].health is Health.DEGRADED
        assert "NVLink peer-to-peer to GPU 2 not working" in got.gpus[5].reasons[0]
        assert got.nvlink == expected(system).nvlink  # the wiring is as it was: only the traffic is dead
    if system == "gb200-tray":
        assert got.gpus[gpu].fabric is not None
        assert decode_health(got.gpus[gpu].fabric)[0] is not FabricHealth.HEALTHY
        assert node_labels(got)[LABEL_NVLINK_FABRIC] != "healthy"

    # Recovery: the counters stay where they rose (hardware does not reset them); a held verdict
    # ends after DCGM's watch window.
    if fault is _replay_errors:
        fault(healthy)
    libnvml_node.write(healthy)
    assert discover(libnvml_node, seconds=HEALTH_HOLD_SECONDS + 1) == expected(system)


def test_libnvml_fabric_state_in_progress_is_published_as_read(libnvml_node: Node) -> None:
    p = profile_for_system("gb200-tray")
    _fabric(state=2)(p)
    libnvml_node.write(p)
    got = discover(libnvml_node)
    assert got.gpus[1].fabric is not None and got.gpus[1].fabric.state is FabricState.IN_PROGRESS
    assert got.fabric == expected("gb200-tray").fabric  # the other three GPUs still name the clique


def test_libnvml_clique_is_named_by_cluster_uuid_and_clique_id_together(libnvml_node: Node) -> None:
    # Two racks reusing one clique id are two NVLink domains (meta-pytorch/torchcomms #3612).
    a = profile_for_system("gb200-tray", "rack-a-tray-01")
    b = profile_for_system("gb200-tray", "rack-b-tray-01")
    assert a.gpus[0].fabric is not None and b.gpus[0].fabric is not None
    assert a.gpus[0].fabric.clique_id == b.gpus[0].fabric.clique_id
    libnvml_node.write(a)
    clique_a = discover(libnvml_node).fabric
    libnvml_node.write(b)
    clique_b = discover(libnvml_node).fabric
    assert clique_a is not None and clique_b is not None
    assert clique_a.clique != clique_b.clique
    assert clique_a.clique.endswith(".4026") and clique_b.clique.endswith(".4026")


# --------------------------------------------------------------------------------------------------
# A GPU that cannot be read changes nothing about the others


def _unreadable(how: str) -> Callable[[Profile, int], None]:
    def apply(p: Profile, gpu: int) -> None:
        g = p.gpus[gpu]
        if how == "lost":
            g.fails["nvmlDeviceGetMemoryInfo"] = GPU_IS_LOST
        elif how == "off the bus":
            g.fails["*"] = GPU_IS_LOST
        elif how == "out of range":
            g.memory_bytes = 1 << 62
        else:
            g.name = b"NVIDIA \xff\xfe"

    return apply


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        pytest.param("lost", "NVML error: GPU is lost", id="libnvml lost at the memory read"),
        pytest.param("off the bus", "NVML error: GPU is lost", id="libnvml off the bus: no handle"),
        pytest.param("out of range", "health unknown: a reading is out of range", id="libnvml memory out of range"),
        pytest.param("decode error", "health unknown: reading it failed: UnicodeDecodeError",
                     id="libnvml name that does not decode"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("system", ["dgx-1v", "a100-pcie-bridged", "dgx-h100", "gb200-tray"])
@pytest.mark.parametrize("after_a_good_cycle", [False, True], ids=["first cycle", "after a good cycle"])
def test_libnvml_a_gpu_that_cannot_be_read_changes_nothing_about_the_others(
    how: str, reason: str, system: str, after_a_good_cycle: bool, libnvml_node: Node
) -> None:
    bad = 2
    if after_a_good_cycle:
        libnvml_node.write(profile_for_system(system))
        discover(libnvml_node)
    p = profile_for_system(system)
    _unreadable(how)(p, bad)
    libnvml_node.write(p)
    got = discover(libnvml_node)
    want = expected(system)
    assert got.gpus[bad].health is Health.FAILED
    assert got.gpus[bad].reasons[0].startswith(reason)
    others = [i for i in range(len(want.gpus)) if i != bad]
    assert [[got.nvlink.links[i][j] for j in others] for i in others] == [
        [want.nvlink.links[i][j] for j in others] for i in others
    ]
    assert got.nvlink.nvswitch == want.nvlink.nvswitch
    assert [got.gpus[i] for i in others] == [want.gpus[i] for i in others]
    assert all(got.link_count(bad, i) == 0 for i in others)
    if after_a_good_cycle or how != "off the bus":
        assert got.gpus[bad].pci_bus_id == want.gpus[bad].pci_bus_id


# --------------------------------------------------------------------------------------------------
# What an older driver lacks, and a driver that is not there


@pytest.mark.parametrize(
    ("function", "note", "change"),
    [
        pytest.param("nvmlDeviceGetGpuFabricInfoV", "GPU fabric: FunctionNotFound", "no fabric",
                     id="libnvml no fabric-info call: no fabric, no clique, noted"),
        pytest.param("nvmlDeviceGetP2PStatus", "NVLink P2P status: FunctionNotFound", None,
                     id="libnvml no P2P status call: nothing claimed about P2P, noted"),
        pytest.param("nvmlDeviceGetNvLinkErrorCounter", "NVLink replay error counter: FunctionNotFound", None,
                     id="libnvml no error counters: absent, the links still counted"),
        pytest.param("nvmlDeviceGetRemappedRows", "remapped rows: FunctionNotFound", None,
                     id="libnvml no remapped rows: noted"),
    ],
)  # fmt: skip
def test_libnvml_a_function_the_driver_lacks_takes_the_fallback(
    function: str, note: str, change: str | None, libnvml_node: Node
) -> None:
    p = profile_for_system("gb200-tray")
    p.absent.add(function)
    libnvml_node.write(p)
    result = libnvml_node.adapter.discover()
    assert note in result.notes
    want = expected("gb200-tray")
    if change == "no fabric":
        gpus = tuple(g.model_copy(update={"fabric": None}) for g in want.gpus)
        want = want.model_copy(update={"gpus": gpus, "fabric": None})
    assert result.topology == want


_MISSING_SYMBOLS_SCRIPT = """
import json, sys
from pathlib import Path
import pynvml
from gputopo.agent.nvml_backend import NvmlAdapter
result = NvmlAdapter(pynvml, sysfs_root=Path(sys.argv[1])).discover()
print(json.dumps({"notes": result.notes, "links": result.topology.nvlink.links,
                  "fabric": result.topology.fabric is not None}))
"""


def test_libnvml_missing_symbols_take_the_bindings_own_function_not_found(tmp_path: Path) -> None:
    # A library built without the symbols, found by LD_LIBRARY_PATH as the agent process finds it.
    lib_dir = build_library(omit=("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetP2PStatus"))
    profile = tmp_path / "profile"
    write_profile(profile, profile_for_system("gb200-tray"))
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir), PROFILE_ENV: str(profile)}
    proc = subprocess.run(
        [sys.executable, "-c", _MISSING_SYMBOLS_SCRIPT, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "GPU fabric: FunctionNotFound" in out["notes"]
    assert "NVLink P2P status: FunctionNotFound" in out["notes"]
    assert out["links"] == [list(r) for r in expected("gb200-tray").nvlink.links]
    assert out["fabric"] is False


@pytest.mark.parametrize(
    ("init_error", "without_profile"),
    [
        pytest.param(9, False, id="libnvml nvmlInit says Driver Not Loaded: clear NvmlUnavailableError"),
        pytest.param(0, True, id="libnvml no profile at all reads as no driver"),
    ],
)
def test_libnvml_no_driver_is_one_clear_error(
    init_error: int, without_profile: bool, libnvml_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = profile_for_system("dgx-1v")
    p.init_error = init_error
    libnvml_node.write(p)
    if without_profile:
        monkeypatch.setenv(PROFILE_ENV, str(libnvml_node.path) + ".missing")
    with pytest.raises(NvmlUnavailableError, match="NVIDIA driver not available"):
        libnvml_node.adapter.discover()


# --------------------------------------------------------------------------------------------------
# Hostile profiles


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param("not a profile\n", "line 1: first line must be", id="libnvml wrong header refused"),
        pytest.param("gputopo-nvml-profile 1\nuuid GPU-x\n", "line 2: a GPU field before the first 'gpu' line",
                     id="libnvml field before any gpu refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 1\n", "line 2: gpu indices must run 0, 1, ...",
                     id="libnvml gpu index out of order refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nnvlink 2\nlink 2 1 2 00:05:00.0 6 0 0 0 0\n",
                     "line 4: bad link line", id="libnvml link index past the count refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nmemory 99999999999999999999999\n", "line 3: bad memory bytes",
                     id="libnvml number overflowing 64 bits refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nmemory -1\n", "line 3: bad memory bytes",
                     id="libnvml negative number refused"),
        pytest.param("gputopo-nvml-profile 1\n" + "# " + "x" * 5000 + "\n", "line 2: line too long",
                     id="libnvml oversized line refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nname " + "N" * 200 + "\n", "line 3: bad name",
                     id="libnvml oversized name refused"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nname bad\\x0\n", "line 3: bad name",
                     id="libnvml broken escape refused"),
        pytest.param("gputopo-nvml-profile 1\n" + "".join(f"gpu {i}\n" for i in range(65)),
                     "line 66: gpu indices must run", id="libnvml flood of GPUs refused past 64"),
        pytest.param("gputopo-nvml-profile 1\ngpu 0\nsurprise 1\n", "line 3: unknown key", id="libnvml unknown key"),
    ],
)  # fmt: skip
def test_libnvml_a_malformed_profile_is_refused_and_a_good_one_recovers(
    text: str, why: str, libnvml_node: Node, capfd: pytest.CaptureFixture[str]
) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    assert discover(libnvml_node) == expected("dgx-1v")
    bad = libnvml_node.path.with_name("bad")
    bad.write_text(text, encoding="ascii")
    bad.replace(libnvml_node.path)
    with pytest.raises(libnvml_node.lib.NVMLError, match="Unknown Error"):
        discover(libnvml_node)
    assert f"profile {libnvml_node.path}: {why}" in capfd.readouterr().err
    libnvml_node.write(profile_for_system("dgx-1v"))
    assert discover(libnvml_node) == expected("dgx-1v")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param(lambda p: setattr(p.gpus[0], "name", "N" * 96), "GPU name", id="libnvml writer: name too long"),
        pytest.param(lambda p: setattr(p.gpus[0], "name", "a\0b"), "GPU name", id="libnvml writer: NUL in name"),
        pytest.param(lambda p: setattr(p.gpus[0], "uuid", "GPU x"), "uuid", id="libnvml writer: space in uuid"),
        pytest.param(lambda p: setattr(p.gpus[0], "bus", "0" * 17), "bus", id="libnvml writer: bus too long"),
        pytest.param(lambda p: p.absent.add("rm -rf"), "NVML function", id="libnvml writer: not a function name"),
        pytest.param(lambda p: p.gpus.extend(p.gpus * 8), "GPUs, at most 64", id="libnvml writer: too many GPUs"),
    ],
)  # fmt: skip
def test_libnvml_profile_writer_refuses_what_the_library_would(change: Callable[[Profile], Any], field: str) -> None:
    p = profile_for_system("dgx-1v")
    change(p)
    with pytest.raises(ValueError, match=field):
        p.render()


@pytest.mark.parametrize(
    "system",
    [
        pytest.param("dgx-h100", id="libnvml agent process, dgx-h100: the document equals the system"),
        pytest.param("gb200-tray", id="libnvml agent process, gb200 tray: fabric and clique published"),
    ],
)
def test_libnvml_agent_process_once_publishes_the_system(system: str, tmp_path: Path) -> None:
    # The agent's own entry point, as a node runs it: --backend nvml, the library found by LD_LIBRARY_PATH.
    profile = tmp_path / "profile"
    write_profile(profile, profile_for_system(system))
    (tmp_path / "sys").mkdir()
    env = {**os.environ, "LD_LIBRARY_PATH": str(build_library()), PROFILE_ENV: str(profile)}
    agent = Path(sys.executable).with_name("gputopo-agent")
    proc = subprocess.run(
        [str(agent), "--backend=nvml", f"--sysfs-root={tmp_path / 'sys'}", "--node-name=n", "--once", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert parse_topology(proc.stdout) == expected(system)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        pytest.param(UNKNOWN_ERROR,
                     "NVLink peer-to-peer to GPUs 1, 2, 3 could not be checked (NVMLError_Unknown: Unknown Error)",
                     id="libnvml P2P status call failing: unknown, never healthy, the peers named"),
        pytest.param(GPU_IS_LOST, None,
                     id="libnvml P2P status says GPU lost: nothing claimed, the reading fails it next"),
    ],
)  # fmt: skip
def test_libnvml_a_p2p_check_that_fails_is_unknown_not_healthy(
    code: int, reason: str | None, libnvml_node: Node
) -> None:
    p = profile_for_system("hgx-a100-4")
    p.gpus[0].fails["nvmlDeviceGetP2PStatus"] = code  # GPU 0 is the first handle of each of its pairs
    libnvml_node.write(p)
    got = discover(libnvml_node)
    if reason is None:
        assert got == expected("hgx-a100-4")
    else:
        assert got.gpus[0].health is Health.DEGRADED
        assert got.gpus[0].reasons == (reason,)
        assert got.gpus[1].reasons == (reason.replace("GPUs 1, 2, 3", "GPU 0"),)
        assert got.nvlink == expected("hgx-a100-4").nvlink


@pytest.mark.parametrize(
    ("omit", "cc", "message"),
    [
        pytest.param(("nvmlBogus",), None, "cannot omit ['nvmlBogus']", id="libnvml build: unknown function to omit"),
        pytest.param((), "/nonexistent/cc", "/nonexistent/cc could not build nvmlmock.c",
                     id="libnvml build: a compiler that is not there named"),
        pytest.param((), "false", "false failed on nvmlmock.c (1)", id="libnvml build: a failing compiler named"),
    ],
)  # fmt: skip
def test_libnvml_build_errors_name_what_went_wrong(
    omit: tuple[str, ...], cc: str | None, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cc is not None:
        monkeypatch.setenv("CC", cc)
    with pytest.raises(LibraryBuildError) as e:
        build_library(cache=tmp_path, omit=omit)
    assert message in str(e.value)
    assert not list(tmp_path.rglob("libnvidia-ml.so.1"))  # nothing half-built left to be reused


# --------------------------------------------------------------------------------------------------
# Xid events through nvmlEventSetWait_v2


RESET = "reset the GPU, then restart the agent"
QUIET = "clears after 300 s without another"


def _append_xid(node: Node, gpu: int, code: int) -> None:
    """An Xid line appended under the running adapter, as the issue's operator would."""
    with node.path.open("a", encoding="ascii") as f:
        f.write(f"xid {gpu} {code}\n")


@pytest.mark.parametrize(
    ("code", "health", "reason"),
    [
        pytest.param(79, Health.FAILED, f"Xid 79: GPU has fallen off the bus (1 Xids seen; {RESET})",
                     id="libnvml Xid 79 fallen off the bus: GPU failed with the Xid named"),
        pytest.param(48, Health.FAILED, f"Xid 48: double-bit ECC error (1 Xids seen; {RESET})",
                     id="libnvml Xid 48 double-bit ECC: GPU failed"),
        pytest.param(74, Health.DEGRADED, f"Xid 74: NVLink error ({QUIET})",
                     id="libnvml Xid 74 NVLink error: GPU degraded"),
        pytest.param(94, Health.DEGRADED, f"Xid 94: contained ECC error ({QUIET})",
                     id="libnvml Xid 94 contained ECC: GPU degraded"),
        pytest.param(31, Health.OK, None, id="libnvml Xid 31 application page fault: GPU stays OK, no reason"),
        pytest.param(43, Health.OK, None, id="libnvml Xid 43 application stopped: GPU stays OK, no reason"),
        pytest.param(9999, Health.DEGRADED, f"Xid 9999: not in the Xid catalogue the agent knows ({QUIET})",
                     id="libnvml unknown Xid: degraded, the code named"),
    ],
)  # fmt: skip
def test_libnvml_xid_under_a_running_adapter_is_published_within_one_discovery(
    code: int, health: Health, reason: str | None, libnvml_node: Node
) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    assert discover(libnvml_node) == expected("dgx-1v")  # registers every GPU for Xid events

    _append_xid(libnvml_node, 2, code)
    got = discover(libnvml_node)
    assert got.gpus[2].health is health
    assert got.gpus[2].reasons == ((reason,) if reason else ())
    assert [g for g in got.gpus if g.index != 2] == [g for g in expected("dgx-1v").gpus if g.index != 2]
    assert got.nvlink == expected("dgx-1v").nvlink
    # Delivered once: the next discovery reads no new Xid and the verdict is the same.
    assert discover(libnvml_node).gpus[2].reasons == got.gpus[2].reasons


def test_libnvml_a_degrading_xid_clears_after_a_quiet_window_and_a_repeat_extends_it(libnvml_node: Node) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    discover(libnvml_node)
    _append_xid(libnvml_node, 5, 74)
    assert discover(libnvml_node).gpus[5].health is Health.DEGRADED
    _append_xid(libnvml_node, 5, 74)  # it happens again: the window starts again
    assert discover(libnvml_node, seconds=XID_QUIET_SECONDS - 1).gpus[5].health is Health.DEGRADED
    assert discover(libnvml_node, seconds=XID_QUIET_SECONDS - 1).gpus[5].health is Health.DEGRADED
    assert discover(libnvml_node, seconds=2) == expected("dgx-1v")


def test_libnvml_a_fatal_xid_holds_until_the_agent_restarts(libnvml_node: Node, real_pynvml: Any) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    discover(libnvml_node)
    _append_xid(libnvml_node, 0, 79)
    assert discover(libnvml_node).gpus[0].health is Health.FAILED
    # NVML never says the GPU was reset: quiet time alone does not clear a fatal Xid.
    assert discover(libnvml_node, seconds=24 * 3600).gpus[0].health is Health.FAILED
    # The operator resets the GPU and restarts the agent: a new adapter, a new event set.
    libnvml_node.adapter.close()
    libnvml_node.adapter = NvmlAdapter(
        real_pynvml, sysfs_root=libnvml_node.path.parent / "sys", clock=libnvml_node.clock
    )
    assert discover(libnvml_node) == expected("dgx-1v")


def test_libnvml_xid_flood_is_bounded_per_poll_and_in_memory(libnvml_node: Node) -> None:
    profile = profile_for_system("dgx-1v")
    libnvml_node.write(profile)
    discover(libnvml_node)
    # Hostile: the library's whole log of application Xids on one GPU, then a fatal one at the end.
    profile.xids = [(3, 31)] * 4095 + [(3, 79)]
    libnvml_node.write(profile)
    polls = [discover(libnvml_node, seconds=1) for _ in range(15)]
    assert all(p.gpus[3].health is Health.OK for p in polls)  # 256 a poll: the fatal one, last, is not read yet
    found = libnvml_node.adapter.discover()
    assert "Xid events: more than 256 queued; the rest next poll" in found.notes
    final = found.topology
    assert final.gpus[3].health is Health.FAILED
    assert final.gpus[3].reasons == (
        "Xid 79: GPU has fallen off the bus (4096 Xids seen; reset the GPU, then restart the agent)",
    )
    memory = libnvml_node.adapter._xid_events.memory.gpus[final.gpus[3].uuid]
    assert len(memory.recent) == RECENT_PER_GPU
    assert [g for g in final.gpus if g.index != 3] == [g for g in expected("dgx-1v").gpus if g.index != 3]


@pytest.mark.parametrize(
    ("change", "note"),
    [
        pytest.param(lambda p: p.absent.add("nvmlEventSetCreate"), "Xid events: FunctionNotFound",
                     id="libnvml driver without the event API: a note, the GPUs published"),
        pytest.param(lambda p: [g.fails.update({"nvmlDeviceRegisterEvents": 3}) for g in p.gpus],
                     "Xid events on GPU 0: NotSupported", id="libnvml a GPU that cannot report Xids: a note"),
    ],
)  # fmt: skip
def test_libnvml_no_xid_events_is_a_note_not_an_error(
    change: Callable[[Profile], Any], note: str, libnvml_node: Node
) -> None:
    profile = profile_for_system("dgx-h100")
    change(profile)
    libnvml_node.write(profile)
    found = libnvml_node.adapter.discover()
    assert found.topology == expected("dgx-h100")
    assert note in found.notes


@pytest.mark.parametrize(
    ("line", "error"),
    [
        pytest.param("xid 0 79\n", "line 2: bad xid line", id="libnvml xid before any GPU refused"),
        pytest.param("gpu 0\nxid 1 79\n", "line 3: bad xid line", id="libnvml xid for a GPU not described refused"),
        pytest.param("gpu 0\nxid 0 -1\n", "line 3: bad xid line", id="libnvml negative xid refused"),
        pytest.param("gpu 0\nxid 0 79 extra\n", "line 3: bad xid line", id="libnvml xid with extra field refused"),
        pytest.param("gpu 0\n" + "xid 0 79\n" * 4097, "line 4099: too many xid lines",
                     id="libnvml xid flood past the library's log refused"),
    ],
)  # fmt: skip
def test_libnvml_a_malformed_xid_line_is_refused(
    line: str, error: str, libnvml_node: Node, capfd: pytest.CaptureFixture[str]
) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    assert discover(libnvml_node) == expected("dgx-1v")
    bad = libnvml_node.path.with_name("bad")
    bad.write_text("gputopo-nvml-profile 1\n" + line, encoding="ascii")
    bad.replace(libnvml_node.path)
    with pytest.raises(libnvml_node.lib.NVMLError, match="Unknown Error"):
        discover(libnvml_node)
    assert error in capfd.readouterr().err
    libnvml_node.write(profile_for_system("dgx-1v"))
    assert discover(libnvml_node) == expected("dgx-1v")


@pytest.mark.parametrize(
    ("xids", "field"),
    [
        pytest.param([(8, 79)], "Xid 79 on GPU 8", id="libnvml writer: Xid on a GPU not in the profile"),
        pytest.param([(0, -1)], "Xid -1 on GPU 0", id="libnvml writer: negative Xid"),
        pytest.param([(0, 79)] * 4097, "4097 Xids, at most 4096", id="libnvml writer: Xid flood"),
    ],
)
def test_libnvml_profile_writer_refuses_bad_xids(xids: list[tuple[int, int]], field: str) -> None:
    profile = profile_for_system("dgx-1v")
    profile.xids = xids
    with pytest.raises(ValueError, match=field):
        profile.render()


def test_libnvml_event_api_refuses_forged_sets_and_types_and_bounds_its_sets(libnvml_node: Node) -> None:
    libnvml_node.write(profile_for_system("dgx-1v"))
    nv = libnvml_node.pynvml
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        forged = ctypes.cast(ctypes.c_void_p(0x1000), nv.c_nvmlEventSet_t)  # not a set the library made
        with pytest.raises(nv.NVMLError_InvalidArgument):
            nv.nvmlDeviceRegisterEvents(handle, 0x8, forged)
        with pytest.raises(nv.NVMLError_InvalidArgument):
            nv.nvmlEventSetWait_v2(forged, 0)
        with pytest.raises(nv.NVMLError_InvalidArgument):
            nv.nvmlEventSetFree(forged)
        sets = []
        with pytest.raises(nv.NVMLError_Unknown):  # a bounded pool: a flood of sets is refused, not grown
            for _ in range(64):
                sets.append(nv.nvmlEventSetCreate())
        assert 0 < len(sets) < 64
        with pytest.raises(nv.NVMLError_NotSupported):  # only critical Xids are modelled
            nv.nvmlDeviceRegisterEvents(handle, 0x8 | 0x1, sets[0])
        with pytest.raises(nv.NVMLError_Timeout):  # nothing queued: the wait answers at once
            nv.nvmlEventSetWait_v2(sets[0], 1000)
        for s in sets:
            nv.nvmlEventSetFree(s)
        with pytest.raises(nv.NVMLError_InvalidArgument):  # freed twice
            nv.nvmlEventSetFree(sets[0])
    finally:
        nv.nvmlShutdown()
