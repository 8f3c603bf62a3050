"""Watch decoding: a chunked watch stream into events, line by line with a bounded line length,
and ERROR events into `KubeError` (`Gone` on 410, so the caller relists).

`kubernetes.watch.Watch` is not used for watches: it wants a typed API function, reads a key it
never sets for ERROR events when asked not to deserialize, and buffers an unbounded line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import orjson

from gputopo.kube.errors import Gone, KubeError
from gputopo.kube.paths import JSON

# One logger for the whole access layer, whichever of its modules writes the line.
log = logging.getLogger("gputopo.kube")

# A watch line is one event holding one object; etcd refuses objects over 1.5 MiB, so a longer line
# is a broken stream, and reading it whole would only cost memory.
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    object: JSON


def iter_lines(chunks: Iterable[bytes], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Non-blank lines of a chunked stream. A line longer than `max_line_bytes` is dropped (logged)
    while it streams past, so one broken event costs neither memory nor the rest of the watch."""

    def too_long() -> None:
        log.warning("skipped a watch line longer than the limit", extra={"limit_bytes": max_line_bytes})

    buf = b""
    skipping = False  # inside an overlong line whose start was already dropped
    for chunk in chunks:
        buf += chunk
        while True:
            cut = buf.find(b"\n")
            if cut < 0:
                break
            line, buf = buf[:cut], buf[cut + 1 :]
            if skipping:
                skipping = False
            elif len(line) > max_line_bytes:
                too_long()
            elif line.strip():
                yield line
        if len(buf) > max_line_bytes:
            if not skipping:
                too_long()
            skipping, buf = True, b""
    if buf.strip() and not skipping:
        yield buf


def decode_event(line: bytes) -> WatchEvent | None:
    """The line's event; None for a line that is not a JSON object (skipped and logged: raising would
    reconnect from the same resourceVersion and meet the same line again). An ERROR event raises its
    Status as `KubeError` (`Gone` for 410)."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as e:  # a ValueError, as json's; invalid UTF-8 lands here too
        log.warning("skipped a watch line that is not JSON", extra={"error": str(e)[:200]})
        return None
    if not isinstance(doc, dict):
        log.warning("skipped a watch line that is not a JSON object")
        return None
    etype = str(doc.get("type", ""))
    obj = doc.get("object")
    obj = obj if isinstance(obj, dict) else {}
    if etype == "ERROR":
        code = int(obj.get("code", 0) or 0)
        cls = Gone if code == 410 else KubeError
        raise cls(code, str(obj.get("message", "")), str(obj.get("reason", "") or ""))
    return WatchEvent(etype, obj)
