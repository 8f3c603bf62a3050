"""Scripted loopback API servers for the list+watch and request-bound tests: `ScriptedApi` answers
lists and watches from two queues (a default for each when its queue is empty) and counts what it
was asked; `DripServer` answers every request with bytes it drips out a few at a time."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

JSON = dict[str, Any]
WAIT_S = 10.0


def status(code: Any, reason: str = "Expired", message: str = "too old resource version") -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def pod(name: str, rv: str) -> JSON:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "resourceVersion": rv},
    }


def line(etype: str, obj: JSON) -> bytes:
    return json.dumps({"type": etype, "object": obj}).encode() + b"\n"


@dataclass(frozen=True)
class Watch:
    """One watch's answer: an HTTP `status` with a Status body, or a 200 streaming `lines`."""

    status: int = 200
    lines: tuple[bytes, ...] = ()


GONE_EVENT = Watch(lines=(line("ERROR", status(410)),))
GONE_STATUS = Watch(status=410)
ENDS_AT_ONCE = Watch()  # 200, no event, the stream ends: a proxy that cuts watches


def events(*names: str, then: tuple[bytes, ...] = ()) -> Watch:
    return Watch(lines=tuple(line("ADDED", pod(n, str(100 + i))) for i, n in enumerate(names)) + then)


@dataclass
class ScriptedApi:
    """Lists answer from `lists` (else one pod at resourceVersion 5), watches from `watches` (else
    `default_watch`). `pages`: when set, answers each list page with `pages(n)` instead (n from 1)."""

    watches: deque[Watch] = field(default_factory=deque)
    default_watch: Watch = GONE_STATUS
    pages: Callable[[int], JSON] | None = None
    lists: int = 0
    watched: list[str] = field(default_factory=list)  # each watch's resourceVersion
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # a head and a body written apart: no delayed-ACK stall between

            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                with api.cond:
                    if query.get("watch") == ["true"]:
                        api.watched.append(query.get("resourceVersion", [""])[0])
                        reply: Watch | JSON = api.watches.popleft() if api.watches else api.default_watch
                    else:
                        api.lists += 1
                        reply = (
                            api.pages(api.lists)
                            if api.pages
                            else {"items": [pod("a", "5")], "metadata": {"resourceVersion": "5"}}
                        )
                    api.cond.notify_all()
                if isinstance(reply, Watch):
                    self._watch(reply)
                else:
                    self._json(200, reply)

            def _json(self, code: int, doc: JSON) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _watch(self, reply: Watch) -> None:
                if reply.status != 200:
                    self._json(reply.status, status(reply.status))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in reply.lines:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DripServer:
    """A loopback socket that answers each request with `head` at once and then `body` (or, with
    `drip_head`, both) `step` bytes at a time every `every_s`, until it is all out or the client
    goes away. Counts the connections that reached the end of their answer."""

    def __init__(
        self, head: bytes, body: bytes, *, drip_head: bool = False, step: int = 1, every_s: float = 0.05
    ) -> None:
        self.head, self.body, self.drip_head, self.step, self.every_s = head, body, drip_head, step, every_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.stop = threading.Event()
        self.finished = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(WAIT_S)
            data = b""
            while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                data += chunk
            out = self.head + self.body
            start = 0 if self.drip_head else len(self.head)
            conn.sendall(out[:start])
            for i in range(start, len(out), self.step):
                if self.stop.wait(self.every_s):
                    return
                conn.sendall(out[i : i + self.step])
            self.finished += 1

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def kubeconfig(path: Path, server: str, *, proxy: str = "") -> Path:
    """A kubeconfig for `server`; with `proxy`, its requests go through it (so the ApiClient carries them)."""
    cluster: JSON = {"server": server}
    if proxy:
        cluster["proxy-url"] = proxy
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(json.dumps(doc))
    return path
