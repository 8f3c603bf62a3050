"""The client's bounds (`gputopo.kube.Kube`) against scripted loopback servers: a request's timeout
bounds it whole (an answer dripped a byte at a time, on the lean transport and through the ApiClient
behind a proxy), a watch that never stops dripping is cut after its grace, a list stops following
continue tokens at its page cap with an error naming the path and the cap, and a watch ERROR event
whose Status code is malformed is the one error type (table-driven, and hypothesis-fuzzed)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.kube import MAX_LIST_PAGES, Gone, Kube, KubeError, decode_event
from gputopo.kube import client as kube_client
from tests.kube.scripted import JSON, DripServer, ScriptedApi, Watch, kubeconfig, pod

DEADLINE_S = 0.5
# Valid JSON (trailing blanks are whitespace) that takes 3 s to drip out a byte every 0.05 s: six
# times the deadline, while each read waits only 0.05 s, far inside it.
NODE = b'{"kind": "Node"}'.ljust(60)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def content_length(body: bytes) -> bytes:
    return HEAD + b"Content-Length: %d\r\n\r\n" % len(body)


def chunked_bytes(body: bytes) -> bytes:
    return b"".join(b"1\r\n%s\r\n" % body[i : i + 1] for i in range(len(body))) + b"0\r\n\r\n"


def get(kube: Kube) -> object:
    return kube.get("/api/v1/nodes/n1")


def list_page(kube: Kube) -> object:
    return kube.list_items("/api/v1/nodes", timeout=DEADLINE_S)


DRIPS = [
    pytest.param(content_length(NODE), NODE, False, 1, get, "", id="body-by-content-length"),
    pytest.param(
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked_bytes(NODE), False, 6, get, "", id="chunked-body"
    ),
    pytest.param(content_length(NODE), NODE, True, 1, get, "", id="head-and-body"),
    pytest.param(
        content_length(b'{"items": [], "metadata": {}}'.ljust(60)),
        b'{"items": [], "metadata": {}}'.ljust(60),
        False,
        1,
        list_page,
        "",
        id="a-list-page",
    ),
    pytest.param(content_length(NODE), NODE, False, 1, get, "proxy", id="body-through-the-api-client"),
]


@pytest.mark.parametrize(("head", "body", "drip_head", "step", "call", "proxy"), DRIPS)
def test_a_dripped_answer_runs_past_the_request_deadline(
    tmp_path: Path, head: bytes, body: bytes, drip_head: bool, step: int, call: Callable[[Kube], object], proxy: str
) -> None:
    server = DripServer(head, body, drip_head=drip_head, step=step)
    config = kubeconfig(tmp_path / "kubeconfig", server.url, proxy=server.url if proxy else "")
    kube = Kube(config, request_timeout=DEADLINE_S)
    try:
        assert (kube.transport is None) == bool(proxy)
        with pytest.raises(KubeError) as err:
            call(kube)
    finally:
        kube.close()
        server.close()
    assert (type(err.value), err.value.status) == (KubeError, 0)
    assert f"within {DEADLINE_S:g} s, its whole deadline" in err.value.message


@pytest.mark.parametrize("proxy", [False, True], ids=["lean", "through-the-api-client"])
def test_a_watch_that_never_stops_dripping_is_cut_after_its_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proxy: bool
) -> None:
    monkeypatch.setattr(kube_client, "WATCH_CONNECT_S", DEADLINE_S / 2)
    monkeypatch.setattr(kube_client, "WATCH_GRACE_S", DEADLINE_S / 2)
    bookmark = json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}}).encode() + b"\n"
    chunk = b"%x\r\n%s\r\n" % (len(bookmark), bookmark)
    server = DripServer(HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunk * 60 + b"0\r\n\r\n", step=len(chunk))
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", server.url, proxy=server.url if proxy else ""))
    seen: list[str] = []
    try:
        with pytest.raises(KubeError) as err:
            seen.extend(e.type for e in kube.watch("/api/v1/pods", "1", timeout_seconds=0))
    finally:
        kube.close()
        server.close()
    assert (type(err.value), err.value.status) == (KubeError, 0)
    assert f"within {DEADLINE_S:g} s, its whole deadline" in err.value.message


# ----------------------------------------------------------------------------------- the page cap


def endless(items_per_page: int, guard: int) -> Callable[[int], JSON]:
    """Pages that always name a next one, up to `guard` (so a client without a cap still ends)."""

    def page(n: int) -> JSON:
        meta = {"resourceVersion": "9", "continue": f"token-{n}"} if n < guard else {"resourceVersion": "9"}
        return {"items": [pod(f"p{n}-{i}", "9") for i in range(items_per_page)], "metadata": meta}

    return page


@pytest.mark.parametrize(
    ("cap", "pages", "requests", "cap_text"),
    [
        pytest.param(5, endless(1, 50), 5, "within 5 pages", id="stops-at-the-page-cap"),
        pytest.param(
            None, endless(1, MAX_LIST_PAGES + 500), MAX_LIST_PAGES, f"within {MAX_LIST_PAGES} pages", id="default-cap"
        ),
        pytest.param(
            3, endless(1000, 50), 2, "within 3 pages", id="a-server-that-ignores-limit-stops-at-the-items-cap"
        ),
    ],
)
def test_a_list_stops_following_continue_tokens_at_its_cap(
    tmp_path: Path, cap: int | None, pages: Callable[[int], JSON], requests: int, cap_text: str
) -> None:
    api = ScriptedApi(pages=pages)
    kw: dict[str, Any] = {} if cap is None else {"max_list_pages": cap}
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", api.url), request_timeout=5.0, **kw)
    try:
        with pytest.raises(KubeError) as err:
            kube.list_items("/api/v1/pods")
    finally:
        kube.close()
        api.close()
    assert (err.value.method, err.value.path, err.value.status) == ("GET", "/api/v1/pods", 0)
    assert cap_text in str(err.value) and "/api/v1/pods" in str(err.value)
    assert api.lists == requests


def test_a_list_that_ends_within_its_cap_returns_every_page(tmp_path: Path) -> None:
    api = ScriptedApi(pages=endless(2, 5))
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", api.url), request_timeout=5.0, max_list_pages=5)
    try:
        items, rv = kube.list_items("/api/v1/pods")
    finally:
        kube.close()
        api.close()
    assert (len(items), rv, api.lists) == (10, "9", 5)


# ----------------------------------------------------------------------------------- malformed watch ERRORs


def error_line(code_json: bytes) -> bytes:
    return b'{"type": "ERROR", "object": {"kind": "Status", "message": "m", "code": ' + code_json + b"}}\n"


@pytest.mark.parametrize(
    ("code_json", "error", "status_code"),
    [
        pytest.param(b"410", Gone, 410, id="410-is-gone"),
        pytest.param(b'"410"', Gone, 410, id="410-as-a-string-is-gone"),
        pytest.param(b"500", KubeError, 500, id="a-numeric-code"),
        pytest.param(b'"abc"', KubeError, 0, id="a-word"),
        pytest.param(b'"4e2"', KubeError, 0, id="a-float-as-a-string"),
        pytest.param(b"410.5", KubeError, 0, id="a-float"),
        pytest.param(b"[410]", KubeError, 0, id="a-list"),
        pytest.param(b'{"a": 1}', KubeError, 0, id="an-object"),
        pytest.param(b"true", KubeError, 0, id="a-boolean"),
        pytest.param(b"null", KubeError, 0, id="null"),
        pytest.param(b"[" * 900 + b"]" * 900, KubeError, 0, id="deeply-nested"),
    ],
)
def test_a_malformed_watch_error_status_is_the_one_error_type(
    tmp_path: Path, code_json: bytes, error: type[KubeError], status_code: int
) -> None:
    api = ScriptedApi(default_watch=Watch(lines=(error_line(code_json),)))
    kube = Kube(kubeconfig(tmp_path / "kubeconfig", api.url), request_timeout=5.0)
    try:
        with pytest.raises(KubeError) as err:
            list(kube.watch("/api/v1/pods", "1", timeout_seconds=5))
    finally:
        kube.close()
        api.close()
    assert (type(err.value), err.value.status) == (error, status_code)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
STATUS_KEYS = st.sampled_from(["code", "message", "reason", "kind", "status"]) | st.text(max_size=8)


@settings(max_examples=400, deadline=None)
@given(
    etype=st.sampled_from(["ERROR", "ADDED"]) | JSON_VALUES,
    obj=st.dictionaries(STATUS_KEYS, JSON_VALUES, max_size=5) | JSON_VALUES,
)
def test_no_watch_line_raises_anything_but_kube_error(etype: object, obj: object) -> None:
    data = json.dumps({"type": etype, "object": obj}).encode()  # NaN and Infinity too: not JSON, skipped
    try:
        event = decode_event(data)
    except KubeError as e:
        assert etype == "ERROR" and isinstance(e.status, int)
        return
    assert event is None or isinstance(event.object, dict)
