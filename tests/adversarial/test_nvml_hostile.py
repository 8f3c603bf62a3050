"""The NVML path under attack: a hostile profile for the mock libnvidia-ml, a cache another user can
write, and a driver answering garbage to the unmodified adapter through the real binding.

Parser cases run the library in a child process, so a crash is a failed test, not a lost session.
Every bound is a count or a size (calls, entries, bytes), never a time.
"""

from __future__ import annotations

import ast
import ctypes
import os
import stat
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.nvml_backend import NvmlAdapter, NvmlDiscoveryError
from gputopo.agent.nvml_health import HealthTracker
from gputopo.localcluster.nvmlmock import (
    PROFILE_ENV,
    LibraryBuildError,
    Profile,
    build_library,
    profile_for_system,
)
from gputopo.localcluster.nvmlmock.build import LIBRARY_NAME
from gputopo.model import (
    MAX_NVLINKS,
    MAX_REASONS,
    MAX_TEXT_LENGTH,
    Health,
    NodeTopology,
    parse_topology,
)
from gputopo.systems import build_system
from tests.agent.libnvml_harness import Node, load_real_binding

GPU_IS_LOST = 15
P2P_OK = 0
P2P_NOT_SUPPORTED = 5
HEADER = b"gputopo-nvml-profile 1\n"
GOOD_GPU = b"gpu 0\nuuid GPU-0\nbus 00000000:07:00.0\nmemory 1073741824\n"


def expected(system: str) -> NodeTopology:
    return build_system(system).model_copy(update={"nics": ()})


# --------------------------------------------------------------------------------------------------
# The profile parser, in a child process

_PROBE = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
count = ctypes.c_uint(0)
init = lib.nvmlInit_v2()
print(init, lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), count.value)
"""


def _probe(profile: Path) -> subprocess.CompletedProcess[str]:
    lib = build_library() / LIBRARY_NAME
    env = {**os.environ, PROFILE_ENV: str(profile)}
    # timeout: only so a parser that blocks fails the test instead of hanging the suite.
    return subprocess.run(
        [sys.executable, "-c", _PROBE, str(lib)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _symlink_to_good(path: Path) -> None:
    target = path.with_name("target")
    target.write_bytes(HEADER + GOOD_GPU)
    path.symlink_to(target)


def _write(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(data)

    return write


@pytest.mark.parametrize(
    ("make", "answer", "why"),
    [
        pytest.param(_write(HEADER + b"   \t \n" + GOOD_GPU), "0 0 1", None,
                     id="a line of blanks only is a blank line, not a crash"),
        pytest.param(_write(HEADER + b"\0gpu 0\n" + GOOD_GPU), "999 999 0", "line 2: a NUL byte",
                     id="a NUL byte hiding a line is refused with its line"),
        pytest.param(_fifo, "999 999 0", "not a regular file", id="a FIFO at the path is refused, never waited on"),
        pytest.param(_directory, "999 999 0", "not a regular file", id="a directory at the path is refused"),
        pytest.param(_write(HEADER + b"# padding\n" * 500_000), "999 999 0", "at most 4194304",
                     id="a profile past 4 MiB is refused before it is read"),
        pytest.param(_write(b""), "999 999 0", "empty file", id="an empty file is refused"),
        pytest.param(_symlink_to_good, "0 0 1", None, id="a symlink (a ConfigMap's) is followed"),
        pytest.param(_write(HEADER + b"# " + b"x" * 5000 + b"\n"), "999 999 0", "line 2: line too long",
                     id="an overlong line is refused"),
        pytest.param(_write(HEADER + b"gpu -1\n"), "999 999 0", "line 2: gpu indices", id="a negative index"),
        pytest.param(_write(HEADER + b"".join(b"gpu %d\n" % i for i in range(65))), "999 999 0", "line 66: gpu",
                     id="a 65th GPU"),
        pytest.param(_write(HEADER + GOOD_GPU + b"memory 18446744073709551616\n"), "999 999 0", "bad memory",
                     id="a count past 2^64 does not wrap"),
        pytest.param(_write(HEADER + GOOD_GPU + b"nvlink 65\n"), "999 999 0", "bad nvlink count",
                     id="more NVLinks than the struct holds"),
        pytest.param(_write(HEADER + GOOD_GPU + b"nvlink 2\nlink 2 1 0 00000000:05:00.0 4 0 0 0 0\n"), "999 999 0",
                     "bad link line", id="a link index past the nvlink count"),
        pytest.param(_write(HEADER + GOOD_GPU + b"nvlink 2\nlink 4294967296 1 0 x 4 0 0 0 0\n"), "999 999 0",
                     "bad link line", id="a link index past 2^32 does not wrap to 0"),
        pytest.param(_write(HEADER + GOOD_GPU + b"p2p 64 0\n"), "999 999 0", "bad p2p", id="a p2p peer past 63"),
        pytest.param(_write(HEADER + GOOD_GPU + b"counter-error 0 0 1\n"), "999 999 0", "bad counter-error",
                     id="a counter error on a GPU without NVLink"),
        pytest.param(_write(HEADER + GOOD_GPU + b"fail " + b"f" * 200 + b" 15\n"), "999 999 0", "bad fail",
                     id="an overlong function name"),
        pytest.param(_write(HEADER + GOOD_GPU + b"name \\x00\n"), "999 999 0", "bad name",
                     id="an escaped NUL in a name"),
    ],
)  # fmt: skip
def test_hostile_profile_is_refused_with_its_reason_never_a_crash(
    make: Callable[[Path], None], answer: str, why: str | None, tmp_path: Path
) -> None:
    path = tmp_path / "profile"
    make(path)
    proc = _probe(path)
    assert proc.returncode == 0, proc.stderr  # a signal (a crash) is a negative code
    assert proc.stdout.split() == answer.split()
    if why is not None:
        assert why in proc.stderr


_REREAD = """
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
path, good, bad = sys.argv[2], sys.argv[3], sys.argv[4]
count = ctypes.c_uint(0)
def rss_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
def version(i):
    with open(path + ".new", "w") as f:
        f.write(good if i % 2 else bad)
    os.replace(path + ".new", path)
    lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
version(1)
lib.nvmlInit_v2()
for i in range(50):
    version(i)
before = rss_kib()
for i in range(1000):
    version(i)
print(rss_kib() - before)
"""


def test_many_rereads_of_changing_profiles_do_not_grow_memory(tmp_path: Path) -> None:
    good = (HEADER + GOOD_GPU).decode()
    bad = (HEADER + b"surprise\n").decode()
    lib = build_library() / LIBRARY_NAME
    env = {**os.environ, PROFILE_ENV: str(tmp_path / "p")}
    proc = subprocess.run(
        [sys.executable, "-c", _REREAD, str(lib), str(tmp_path / "p"), good, bad],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) < 2048  # KiB over 1000 re-reads: one profile leaked would be ~600


_RACE = """
import ctypes, os, sys, threading
lib = ctypes.CDLL(sys.argv[1])
path, one, eight = sys.argv[2], sys.argv[3], sys.argv[4]
count = ctypes.c_uint(0)
def put(text, tmp):
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
put(one, path + ".w")
lib.nvmlInit_v2()
def writer():
    for i in range(400):
        put(eight if i % 2 else one, path + ".w")
t = threading.Thread(target=writer)
t.start()
seen = set()
while t.is_alive():
    rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    seen.add((rc, count.value if rc == 0 else None))
t.join()
print(sorted(seen))
"""


def test_a_profile_renamed_over_while_read_is_seen_whole_old_or_whole_new(tmp_path: Path) -> None:
    one = (HEADER + GOOD_GPU).decode()
    eight = (HEADER + b"".join(b"gpu %d\nuuid GPU-%d\n" % (i, i) for i in range(8))).decode()
    lib = build_library() / LIBRARY_NAME
    path = tmp_path / "p"
    proc = subprocess.run(
        [sys.executable, "-c", _RACE, str(lib), str(path), one, eight],
        env={**os.environ, PROFILE_ENV: str(path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(ast.literal_eval(proc.stdout)) <= {(0, 1), (0, 8)}  # never a half-read profile, never an error
    assert "libnvidia-ml" not in proc.stderr


# --------------------------------------------------------------------------------------------------
# The build cache: nothing another user can write is loaded


def _world_writable(path: Path) -> None:
    path.chmod(0o777)


def _foreign(path: Path) -> None:
    os.chown(path, 4242, -1)


def _planted_symlink(lib: Path) -> None:
    planted = lib.with_name("planted.so")
    lib.rename(planted)
    lib.symlink_to(planted)


@pytest.mark.parametrize(
    ("where", "attack", "refused"),
    [
        pytest.param("lib", _world_writable, "can be written by another user", id="a world-writable library refused"),
        pytest.param("lib", _planted_symlink, "not a plain folder or file", id="a library that is a link refused"),
        pytest.param("key", _world_writable, "can be written by another user", id="a world-writable build dir refused"),
        pytest.param("mock", _world_writable, "can be written by another user",
                     id="a world-writable nvmlmock dir refused"),
        pytest.param("root", _world_writable, "can be written by another user",
                     id="a world-writable cache root without the sticky bit refused"),
        pytest.param("root", lambda p: p.chmod(0o1777), None, id="a sticky shared cache root (as /tmp) is used"),
        pytest.param("lib", _foreign, "owner uid 4242", id="another user's library refused",
                     marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")),
    ],
)  # fmt: skip
def test_a_cache_another_user_can_write_is_never_loaded(
    where: str, attack: Callable[[Path], None], refused: str | None, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    key_dir = build_library(cache=root)
    paths = {"lib": key_dir / LIBRARY_NAME, "key": key_dir, "mock": key_dir.parent, "root": root}
    attack(paths[where])
    if refused is None:
        assert build_library(cache=root) == key_dir
        return
    with pytest.raises(LibraryBuildError, match=refused) as e:
        build_library(cache=root)
    assert str(paths[where]) in str(e.value)


def test_concurrent_builds_into_one_cache_agree_and_leave_one_library(tmp_path: Path) -> None:
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(build_library(cache=tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and len(got) == 3
    assert [p.name for p in tmp_path.rglob("*.so*")] == [LIBRARY_NAME]
    # A whole library, not half of one; loaded in a child, as this process binds pynvml to the cache's own.
    load = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    assert subprocess.run([sys.executable, "-c", load, str(got[0] / LIBRARY_NAME)], check=False).returncode == 0
    assert not stat.S_IMODE((got[0] / LIBRARY_NAME).stat().st_mode) & 0o022


# --------------------------------------------------------------------------------------------------
# A driver answering garbage, through the real binding


class Driver:
    """The real binding with some calls answered by a hostile driver instead; every NVML call counted."""

    def __init__(self, pynvml: Any, **overrides: Callable[..., Any]) -> None:
        self._pynvml = pynvml
        self._overrides = overrides
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        real = self._overrides.get(name) or getattr(self._pynvml, name)
        if not name.startswith("nvml"):
            return real

        def counted(*args: Any) -> Any:
            self.calls[name] += 1
            return real(*args)

        return counted


@pytest.fixture(scope="module")
def pynvml() -> Any:
    return load_real_binding()[0]


@pytest.fixture
def node(pynvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    path = tmp_path / "nvml-profile"
    monkeypatch.setenv(PROFILE_ENV, str(path))
    n = Node(pynvml, path, tmp_path / "sys")
    yield n
    n.adapter.close()


def _is_gpu(pynvml: Any, handle: Any, index: int) -> bool:
    other = pynvml.nvmlDeviceGetHandleByIndex(index)
    return bool(ctypes.cast(handle, ctypes.c_void_p).value == ctypes.cast(other, ctypes.c_void_p).value)


def _adapter(node: Node, lib: Any, tracker: HealthTracker | None = None) -> NvmlAdapter:
    node.adapter.close()
    node.adapter = NvmlAdapter(lib, sysfs_root=node.path.parent / "sys", clock=node.clock, tracker=tracker)
    return node.adapter


def _discover(node: Node) -> NodeTopology:
    node.clock.now += 10
    topology = node.adapter.discover().topology
    assert parse_topology(topology.to_annotation()) == topology  # what is published reads back
    return topology


def _self_loop(p: Profile) -> None:
    assert p.gpus[0].links is not None
    p.gpus[0].links[0].remote_bus = p.gpus[0].bus


@pytest.mark.parametrize("bus", ["/etc", "../../../proc", "zz:yy:xx.q", "0000:07:00.0/x"])
def test_a_gpu_bus_id_out_of_format_fails_that_gpu_only(bus: str, node: Node) -> None:
    """pytest ids: each bus id out of domain:bus:device.function form (paths, garbage) fails that GPU
    alone; it is never joined into a sysfs path nor published."""
    profile = profile_for_system("dgx-1v")
    profile.gpus[2].bus = bus
    node.write(profile)
    got = _discover(node)
    assert got.gpus[2].health is Health.FAILED
    assert got.gpus[2].pci_bus_id in ("", expected("dgx-1v").gpus[2].pci_bus_id)
    assert any("PCI bus id" in r for r in got.gpus[2].reasons)
    others = [i for i in range(8) if i != 2]
    assert [got.gpus[i] for i in others] == [expected("dgx-1v").gpus[i] for i in others]
    assert not got.nvlink.nvswitch


def test_a_link_to_the_gpu_itself_invents_no_nvswitch(node: Node) -> None:
    profile = profile_for_system("dgx-1v")
    _self_loop(profile)
    node.write(profile)
    got = _discover(node)
    assert not got.nvlink.nvswitch
    want = expected("dgx-1v").nvlink.links
    assert all(got.nvlink.links[i][j] <= want[i][j] for i in range(8) for j in range(8))


def test_more_nvlinks_than_the_model_holds_fail_that_gpu_only(pynvml: Any, node: Node) -> None:
    node.write(profile_for_system("dgx-a100"))
    real_state = pynvml.nvmlDeviceGetNvLinkState

    def endless(handle: Any, link: int) -> int:
        # GPU 3's driver never rejects a link index: every one is Active, to an NVSwitch.
        return 1 if _is_gpu(pynvml, handle, 3) else real_state(handle, link)

    def remote(handle: Any, link: int) -> int:
        return 2 if link >= 12 else pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)

    def counter(handle: Any, link: int, c: int) -> int:
        return 0 if link >= 12 else pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, c)

    driver = Driver(
        pynvml,
        nvmlDeviceGetNvLinkState=endless,
        nvmlDeviceGetNvLinkRemoteDeviceType=remote,
        nvmlDeviceGetNvLinkErrorCounter=counter,
    )
    _adapter(node, driver)
    got = _discover(node)
    assert got.gpus[3].health is Health.FAILED
    assert any(f"more than {MAX_NVLINKS} NVLinks" in r for r in got.gpus[3].reasons)
    assert driver.calls["nvmlDeviceGetNvLinkState"] <= 8 * (MAX_NVLINKS + 1)
    others = [i for i in range(8) if i != 3]
    assert [got.gpus[i] for i in others] == [expected("dgx-a100").gpus[i] for i in others]


def test_an_nvml_error_of_any_length_is_a_bounded_reason(pynvml: Any, node: Node) -> None:
    node.write(profile_for_system("dgx-1v"))

    class Verbose(pynvml.NVMLError_Unknown):  # type: ignore[misc]
        def __str__(self) -> str:
            return "garbage " * 100_000

    def memory(handle: Any) -> Any:
        if _is_gpu(pynvml, handle, 2):
            raise Verbose(999)
        return pynvml.nvmlDeviceGetMemoryInfo(handle)

    _adapter(node, Driver(pynvml, nvmlDeviceGetMemoryInfo=memory))
    got = _discover(node)
    assert got.gpus[2].health is Health.FAILED
    assert all(len(r) <= MAX_TEXT_LENGTH for r in got.gpus[2].reasons)
    assert got.gpus[2].reasons[0].startswith("NVML error: garbage")
    assert got.gpus[0] == expected("dgx-1v").gpus[0]


@pytest.mark.parametrize(
    "count",
    [
        pytest.param(65, id="65 GPUs: one past the model, refused naming the count, no GPU read"),
        pytest.param(1024, id="1024 GPUs: refused naming the count, no GPU read"),
        pytest.param(2**32 - 1, id="2^32-1 GPUs: refused naming the count, no GPU read"),
    ],
)
def test_a_gpu_count_past_the_model_is_one_clear_error_and_no_gpu_calls(count: int, pynvml: Any, node: Node) -> None:
    node.write(profile_for_system("dgx-h100"))
    driver = Driver(pynvml, nvmlDeviceGetCount=lambda: count)
    _adapter(node, driver)
    with pytest.raises(NvmlDiscoveryError, match=f"{count} GPUs"):
        _discover(node)
    assert driver.calls["nvmlDeviceGetHandleByIndex"] == 0


def test_no_gpus_is_an_empty_node_not_a_crash(node: Node) -> None:
    node.write(Profile(gpus=[]))
    got = _discover(node)
    assert got.gpus == () and got.nvlink.links == ()


def test_uuids_changing_every_poll_keep_the_adapters_memory_bounded(pynvml: Any, node: Node) -> None:
    """A driver that invents UUIDs (or GPUs swapped without end): link history is kept only for the GPUs
    there now, so it stays at one entry per link however many polls."""
    tracker = HealthTracker()
    _adapter(node, pynvml, tracker)
    profile = profile_for_system("dgx-h100")
    links = sum(len(g.links or ()) for g in profile.gpus)
    for poll in range(30):
        for i, g in enumerate(profile.gpus):
            g.uuid = f"GPU-{poll:04d}{i:04d}-0000-0000-0000-000000000000"
        node.write(profile)
        got = _discover(node)
        assert [g.uuid for g in got.gpus] == [g.uuid for g in profile.gpus]
    assert len(tracker.ever_active) <= links
    assert len(tracker.baselines) <= links
    assert len(tracker.held) <= links


def test_a_gpu_lost_on_alternate_polls_changes_nothing_else_and_grows_nothing(pynvml: Any, node: Node) -> None:
    tracker = HealthTracker()
    _adapter(node, pynvml, tracker)
    healthy = profile_for_system("dgx-1v")
    lost = profile_for_system("dgx-1v")
    lost.gpus[5].fails["*"] = GPU_IS_LOST
    links = sum(len(g.links or ()) for g in healthy.gpus)
    want = expected("dgx-1v")
    for poll in range(20):
        node.write(lost if poll % 2 else healthy)
        got = _discover(node)
        if poll % 2:
            assert got.gpus[5].health is Health.FAILED
            assert (got.gpus[5].uuid, got.gpus[5].pci_bus_id) == (want.gpus[5].uuid, want.gpus[5].pci_bus_id)
            assert not got.nvlink.nvswitch
            others = [i for i in range(8) if i != 5]
            assert all(got.nvlink.links[i][j] == want.nvlink.links[i][j] for i in others for j in others)
        else:
            assert got == want
        assert all(len(g.reasons) <= MAX_REASONS for g in got.gpus)
    assert len(tracker.ever_active) <= links and len(tracker.baselines) <= links


def test_p2p_flapping_every_poll_is_published_as_read_with_one_call_per_pair(pynvml: Any, node: Node) -> None:
    driver = Driver(pynvml)
    _adapter(node, driver)
    want = expected("dgx-a100")
    pairs = 8 * 7 // 2
    for poll in range(10):
        profile = profile_for_system("dgx-a100")
        if poll % 2:
            profile.gpus[1].p2p[6] = P2P_NOT_SUPPORTED
        node.write(profile)
        before = driver.calls["nvmlDeviceGetP2PStatus"]
        got = _discover(node)
        assert driver.calls["nvmlDeviceGetP2PStatus"] - before <= pairs
        assert got.nvlink == want.nvlink  # the wiring never changes with the traffic
        if poll % 2:
            assert got.gpus[1].health is Health.DEGRADED and got.gpus[6].health is Health.DEGRADED
            assert len(got.gpus[1].reasons) == 1
        else:
            assert got == want


@pytest.mark.parametrize(
    ("state", "status", "cluster", "clique", "mask"),
    [
        pytest.param(3, 0, "ff" * 16, 0xFFFFFFFF, 0xFFFFFFFF, id="every field at its widest: published, bounded"),
        pytest.param(200, 0, "ab" * 16, 7, 0, id="an unknown fabric state: no fabric published"),
        pytest.param(3, 0xFFFFFFFF, "ab" * 16, 7, 0, id="a status past every NVML code: degraded with the code"),
        pytest.param(3, 0, "00" * 16, 0xFFFFFFFF, 0xFFFFFFFF, id="a zero cluster UUID: no clique"),
    ],
)
def test_odd_fabric_info_stays_within_the_model(
    state: int, status: int, cluster: str, clique: int, mask: int, node: Node
) -> None:
    profile = profile_for_system("gb200-tray")
    for g in profile.gpus:
        assert g.fabric is not None
        g.fabric.state, g.fabric.status, g.fabric.clique_id, g.fabric.health_mask = state, status, clique, mask
        g.fabric.cluster_uuid = bytes.fromhex(cluster)
    node.write(profile)
    got = _discover(node)
    assert all(len(r) <= MAX_TEXT_LENGTH for g in got.gpus for r in g.reasons)
    if got.fabric is not None:
        assert got.fabric.clique.endswith(f".{clique}")
    if status:
        assert all(g.health is not Health.OK for g in got.gpus)


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(3, id="NotSupported for one GPU's pairs: the other pairs are still checked"),
        pytest.param(2, id="InvalidArgument for one GPU's pairs: the other pairs are still checked"),
    ],
)
def test_one_gpu_refusing_the_p2p_call_hides_no_other_pairs_fault(code: int, node: Node) -> None:
    profile = profile_for_system("dgx-a100")
    profile.gpus[0].fails["nvmlDeviceGetP2PStatus"] = code
    profile.gpus[2].p2p[5] = P2P_NOT_SUPPORTED
    profile.gpus[5].p2p[2] = P2P_NOT_SUPPORTED
    node.write(profile)
    got = _discover(node)
    assert got.gpus[2].health is Health.DEGRADED and got.gpus[5].health is Health.DEGRADED
    assert "NVLink peer-to-peer to GPU 5 not working" in got.gpus[2].reasons[0]
    assert got.nvlink == expected("dgx-a100").nvlink


def test_two_gpus_claiming_one_bus_id_are_failed_and_invent_no_links(node: Node) -> None:
    profile = profile_for_system("dgx-1v")
    profile.gpus[1].bus = profile.gpus[2].bus
    node.write(profile)
    got = _discover(node)
    assert [got.gpus[i].health for i in (1, 2)] == [Health.FAILED, Health.FAILED]
    assert all(any("PCI bus id" in r for r in got.gpus[i].reasons) for i in (1, 2))
    buses = [g.pci_bus_id for g in got.gpus if g.pci_bus_id]
    assert len(buses) == len(set(buses))  # never one bus published for two GPUs
    assert not got.nvlink.nvswitch
    want = expected("dgx-1v").nvlink.links
    others = [i for i in range(8) if i not in (1, 2)]
    assert all(got.nvlink.links[i][j] == want[i][j] for i in others for j in others)


def test_a_maximal_node_costs_calls_bounded_by_its_gpus_and_links(pynvml: Any, node: Node) -> None:
    """64 GPUs of 64 Active links each, to NVSwitches: the calls of one discovery stay within a fixed
    number per GPU, per link and per NVLink pair (the CPU per discovery, counted, not timed)."""
    from gputopo.localcluster.nvmlmock import GpuSpec, LinkSpec

    gpus = [
        GpuSpec(
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            bus=f"00000000:{i + 16:02X}:00.0",
            memory_bytes=80 << 30,
            links=[LinkSpec(version=4) for _ in range(MAX_NVLINKS)],
        )
        for i in range(64)
    ]
    node.write(Profile(gpus=gpus))
    driver = Driver(pynvml)
    _adapter(node, driver)
    got = _discover(node)
    assert len(got.gpus) == 64 and got.nvlink.links[0][1] == MAX_NVLINKS
    per_gpu, per_link, pairs = 12, 8, 64 * 63 // 2
    assert sum(driver.calls.values()) <= 1 + 64 * (per_gpu + MAX_NVLINKS * per_link) + pairs


def test_two_gpus_claiming_one_uuid_are_failed_so_neither_device_is_handed_out(node: Node) -> None:
    profile = profile_for_system("dgx-a100")
    profile.gpus[6].uuid = profile.gpus[3].uuid
    node.write(profile)
    got = _discover(node)
    assert [got.gpus[i].health for i in (3, 6)] == [Health.FAILED, Health.FAILED]
    assert all(any(f"UUID {profile.gpus[3].uuid}" in r for r in got.gpus[i].reasons) for i in (3, 6))
    want = expected("dgx-a100")
    assert [got.gpus[i] for i in (0, 1, 2, 4, 5, 7)] == [want.gpus[i] for i in (0, 1, 2, 4, 5, 7)]
