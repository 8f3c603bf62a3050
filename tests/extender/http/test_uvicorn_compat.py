"""`BoundedHttpTools` (gputopo.extender.http.uvicornprotocol) overrides and reads private parts of uvicorn's httptools
protocol.
These fail, naming the part, on a uvicorn that no longer has them as relied on; the range in pyproject.toml is the
one they passed on."""

from __future__ import annotations

import asyncio
import collections
import inspect
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from gputopo.extender.http.uvicornprotocol import BoundedHttpTools, bounded_protocol

# Each method BoundedHttpTools overrides or calls, with the parameters (after self) it is called with.
_METHODS = {
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_message_begin": [],
    "on_headers_complete": [],
    "on_message_complete": [],
    "on_response_complete": [],
    "pause_writing": [],
    "resume_writing": [],
    "timeout_keep_alive_handler": [],
    "_unset_keepalive_if_required": [],
}
# What a request's cycle holds that the refusals read.
_CYCLE = ("more_body", "response_complete", "response_started", "waiting_for_100_continue")


def _incompatible(what: str) -> str:
    relier = "gputopo.extender.http.uvicornprotocol.BoundedHttpTools"
    return f"uvicorn {uvicorn.__version__} changed {what}, which {relier} relies on"


@pytest.mark.parametrize("name", sorted(_METHODS))
def test_overridden_methods_keep_their_signatures(name: str) -> None:
    method = getattr(httptools_impl.HttpToolsProtocol, name, None)
    assert callable(method), _incompatible(f"HttpToolsProtocol.{name} (gone)")
    params = list(inspect.signature(method).parameters)[1:]
    assert params == _METHODS[name], _incompatible(f"HttpToolsProtocol.{name}'s parameters ({params})")


def _protocol(loop: asyncio.AbstractEventLoop) -> Any:
    config = uvicorn.Config(app=lambda *a: None, http="httptools", lifespan="off")
    config.load()
    return httptools_impl.HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)


def test_connection_state_is_where_the_overrides_read_it() -> None:
    loop = asyncio.new_event_loop()
    try:
        proto = _protocol(loop)
        for name in ("cycle", "scope", "expect_100_continue", "timeout_keep_alive", "parser", "loop", "transport"):
            assert hasattr(proto, name), _incompatible(f"HttpToolsProtocol.{name} (gone)")
        assert isinstance(proto.pipeline, collections.deque), _incompatible("HttpToolsProtocol.pipeline (not a deque)")
        assert isinstance(proto.server_state.total_requests, int), _incompatible("ServerState.total_requests")
        # A subclass made per listener still builds as uvicorn builds its protocol.
        assert isinstance(
            bounded_protocol(BoundedHttpTools.limits)(
                config=proto.config, server_state=ServerState(), app_state={}, _loop=loop
            ),
            httptools_impl.HttpToolsProtocol,
        )
    finally:
        loop.close()


def test_cycle_state_is_where_the_refusals_read_it() -> None:
    params = list(inspect.signature(httptools_impl.RequestResponseCycle).parameters)
    assert "expect_100_continue" in params and "on_response" in params, _incompatible(
        f"RequestResponseCycle's parameters ({params})"
    )
    nothing: dict[str, Any] = dict.fromkeys(params)  # the constructor only stores its arguments
    cycle = httptools_impl.RequestResponseCycle(**nothing)
    for name in _CYCLE:
        assert hasattr(cycle, name), _incompatible(f"RequestResponseCycle.{name} (gone)")


def test_the_keepalive_timer_and_answers_go_through_the_overridden_methods() -> None:
    # The overrides take effect only where uvicorn calls these through self: its source says so.
    source = inspect.getsource(httptools_impl.HttpToolsProtocol)
    for use in ("on_response=self.on_response_complete", "self.timeout_keep_alive_handler", "self.pipeline.pop()"):
        assert use in source, _incompatible(f"how HttpToolsProtocol uses {use.split('=')[-1]}")
    assert "self.pipeline.appendleft(" in source, _incompatible("the order of HttpToolsProtocol.pipeline")
