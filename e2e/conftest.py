"""Shared fixtures of the end-to-end suite: one real local control plane per test session.

The upstream binaries must already be built (``gputopo/localcluster/build_binaries.sh``, once per
machine); without them every e2e test fails with instructions. ``GPUTOPO_E2E_BUILD=1`` builds them
here instead (tens of minutes the first time). ``GPUTOPO_E2E_KEEP=1`` keeps the control plane's
directory (logs, kubeconfig) after the session. ``GPUTOPO_E2E_FEATURE_GATES=Name=true,Other=false``
goes to kube-apiserver, the kube-schedulers and kube-controller-manager, and
``GPUTOPO_E2E_RUNTIME_CONFIG=api/beta=true`` to kube-apiserver. Failed e2e tests get the tail of
every component's log attached to their report.

The real job controllers (JobSet, LeaderWorkerSet, Kueue, Kubeflow Trainer) come from
``gputopo/localcluster/build_controllers.sh`` (``GPUTOPO_CONTROLLERS_DIR`` names a ready build); without
them the tests that use them fail with instructions. Once started they stay for the session, with their
CRDs and webhooks (whose pod webhooks see only their own pods and Kueue only namespaces labelled for it).

Tests share the session's cluster, so nodes from one test are visible to the others: create nodes
through ``make_nodes`` (unique names, a per-test label, deleted afterwards) and select them with
``nodeSelector`` on that label, or with a scheduler that only sees what you intend.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import pytest

from gputopo.localcluster import (
    TEST_LABEL,
    ApiFeatures,
    ControlPlane,
    FlagError,
    KubeApiError,
    KubeClient,
    Lifetime,
    SimNode,
    ensure_binaries,
    expected_bin_dir,
    find_binaries,
    parse_flag_map,
)
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.controllermanifests import start_order
from gputopo.localcluster.jobcontrollers import JobControllers, controllers_missing, find_controllers_dir
from gputopo.localcluster.stack import GpuNode, Stack

MakeNodes = Callable[[Sequence[SimNode]], list[str]]


def _bin_dir() -> Path:
    found = find_binaries()
    if found is not None:
        return found
    if os.environ.get("GPUTOPO_E2E_BUILD") == "1":
        return ensure_binaries(lambda line: print(line, file=sys.stderr))
    pytest.fail(
        "e2e: the upstream control-plane binaries are not built (expected in "
        f"{expected_bin_dir()}). Build them once per machine with "
        "`bash gputopo/localcluster/build_binaries.sh` (needs Go; tens of minutes the first time), "
        "or set GPUTOPO_E2E_BUILD=1 to build from pytest, or GPUTOPO_BIN_DIR to a ready directory.",
        pytrace=False,
    )


FEATURE_GATES_ENV = "GPUTOPO_E2E_FEATURE_GATES"
RUNTIME_CONFIG_ENV = "GPUTOPO_E2E_RUNTIME_CONFIG"


# Gates the session's control plane turns on by release, under what GPUTOPO_E2E_FEATURE_GATES says:
# list-typed DRA attributes (alpha from 1.36) for e2e/test_dra.py's list encoding.
DEFAULT_GATES: tuple[tuple[tuple[int, int], str], ...] = (((1, 36), "DRAListTypeAttributes"),)


def _default_gates(bin_dir: Path) -> dict[str, bool]:
    version = kubernetes_version(bin_dir)[:2]
    return {gate: True for since, gate in DEFAULT_GATES if version >= since}


def _flag_env(name: str) -> dict[str, bool]:
    try:
        return parse_flag_map(os.environ.get(name, ""), source=name)
    except FlagError as e:
        pytest.fail(f"e2e: {e}", pytrace=False)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """etcd, kube-apiserver and kube-controller-manager, started once per session; schedulers are
    added by tests."""
    bin_dir = _bin_dir()
    keep = os.environ.get("GPUTOPO_E2E_KEEP") == "1"
    t0 = time.monotonic()
    try:
        cp = ControlPlane(
            bin_dir,
            lifetime=Lifetime(keep=keep),
            features=ApiFeatures(
                feature_gates={**_default_gates(bin_dir), **_flag_env(FEATURE_GATES_ENV)},
                runtime_config=_flag_env(RUNTIME_CONFIG_ENV),
            ),
        )
    except FlagError as e:
        pytest.fail(f"e2e: {FEATURE_GATES_ENV} or {RUNTIME_CONFIG_ENV}: {e}", pytrace=False)
    cp.start()
    try:
        cp.start_controller_manager()
    except BaseException:
        cp.teardown()
        raise
    print(f"\ne2e control plane up in {time.monotonic() - t0:.1f}s: {cp.dir}", file=sys.stderr)
    try:
        yield cp
    finally:
        cp.teardown()
        if keep:
            print(f"\ne2e control plane directory kept: {cp.dir}", file=sys.stderr)


@pytest.fixture(scope="session")
def job_controllers(control_plane: ControlPlane, kube: KubeClient) -> JobControllers:
    """The session's real job controllers, each started on first ``ensure(name)`` (with what it needs) and
    stopped with the control plane. Fails with instructions when they are not built."""
    directory = find_controllers_dir()
    if directory is None:
        pytest.fail(f"e2e: {controllers_missing(directory, ())}", pytrace=False)
    return JobControllers(control_plane, kube, directory)


@pytest.fixture
def controllers(job_controllers: JobControllers) -> Callable[..., None]:
    """``controllers("kueue")``: the named controllers run (started on first use, with what they need)."""

    def ensure(*names: str) -> None:
        missing = controllers_missing(job_controllers.directory, start_order(names))
        if missing is not None:
            pytest.fail(f"e2e: {missing}", pytrace=False)
        before = set(job_controllers.running)
        job_controllers.ensure(*names)
        for name in job_controllers.running:
            if name not in before:
                print(f"\n{name} controller up in {job_controllers.startup_seconds[name]:.1f}s", file=sys.stderr)

    return ensure


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> Iterator[KubeClient]:
    """Admin client (system:masters) of the session's cluster."""
    client = control_plane.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def plain_scheduler(control_plane: ControlPlane) -> str:
    """A kube-scheduler with the single profile ``plain-scheduler`` and no extender; returns the
    schedulerName to put on pods."""
    control_plane.start_plain_scheduler()
    return "plain-scheduler"


def _slug(text: str, limit: int = 30) -> str:
    out = "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out[:limit].strip("-") or "t"


@pytest.fixture
def test_id(request: pytest.FixtureRequest) -> str:
    """A short unique name for this test, usable in object names and label values."""
    return f"{_slug(request.node.name, 40)}-{secrets.token_hex(3)}"


@pytest.fixture
def namespace(kube: KubeClient, test_id: str) -> str:
    """A fresh namespace for this test (never deleted: no namespace controller runs)."""
    kube.create_namespace(test_id)
    return test_id


@pytest.fixture
def make_nodes(kube: KubeClient, test_id: str) -> Iterator[MakeNodes]:
    """``make_nodes([SimNode(...), ...]) -> names``: creates the nodes with the label
    ``gputopo.io/e2e-test=<test id>`` and deletes them after the test."""
    created: list[str] = []

    def make(nodes: Sequence[SimNode]) -> list[str]:
        tagged = [dataclasses.replace(n, labels={**n.labels, TEST_LABEL: test_id}) for n in nodes]
        kube.create_nodes(tagged)
        created.extend(n.name for n in tagged)
        return [n.name for n in tagged]

    yield make
    for name in created:
        try:
            kube.delete_node(name)
        except KubeApiError as e:
            if e.status != 404:
                raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and call.when != "teardown":
        cp = getattr(item, "funcargs", {}).get("control_plane")
        if isinstance(cp, ControlPlane):
            for name in cp.components():
                report.sections.append((f"log tail: {name} ({cp.log_path(name)})", cp.log_tail(name, 30)))
    return report


S = TypeVar("S", bound=Stack)


def serve(stack: S) -> Iterator[S]:
    """The body of a module's `stack` fixture (``yield from serve(Stack(...))``): starts the stack, hands
    it to the module's tests, stops it after them."""
    stack.start()
    yield stack
    stack.stop()


class StackNodes:
    """A test's simulated GPU nodes on a module's Stack (labelled with the test id) and their agents,
    removed afterwards. Modules that run a Stack define a `stack` fixture and get `nodes` from here."""

    def __init__(self, stack: Stack, test_id: str) -> None:
        self.stack = stack
        self.test_id = test_id
        self.names: list[str] = []

    def add(self, *nodes: GpuNode) -> list[str]:
        named = [dataclasses.replace(n, name=f"{n.name}-{self.test_id[-6:]}") for n in nodes]
        self.stack.add_nodes(named, extra_labels={TEST_LABEL: self.test_id})
        self.names.extend(n.name for n in named)
        self.stack.wait_published([n.name for n in named])
        return [n.name for n in named]

    def cleanup(self) -> None:
        for name in self.names:
            self.stack.cp.remove(self.stack.agent_component(name), grace=2)
            try:
                self.stack.kube.delete_node(name)
            except KubeApiError as e:
                if e.status != 404:
                    raise


@pytest.fixture
def nodes(stack: Stack, test_id: str) -> Iterator[StackNodes]:
    n = StackNodes(stack, test_id)
    yield n
    n.cleanup()
