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

from gputopo.kube import jsonbody
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
    Status as `KubeError` (`Gone` for 410; `error_event`)."""
    try:
        doc = jsonbody.loads(line)
    except orjson.JSONDecodeError as e:  # a ValueError, as json's; invalid UTF-8 lands here too
        log.warning("skipped a watch line that is not JSON", extra={"error": str(e)[:200]})
        return None
    if not isinstance(doc, dict):
        log.warning("skipped a watch line that is not a JSON object")
        return None
    etype = doc.get("type", "")
    if not isinstance(etype, str):
        log.warning("skipped a watch line whose type is not a string")
        return None
    obj = doc.get("object")
    obj = obj if isinstance(obj, dict) else {}
    if etype == "ERROR":
        raise error_event(obj)
    return WatchEvent(etype, obj)


def error_event(status: JSON) -> KubeError:
    """The error an ERROR event's Status stands for: `Gone` for code 410, `KubeError` for any other,
    and `KubeError` status 0 when the code is missing or not a number (a malformed Status is still a
    failed watch, never a crash of the thread that reads it)."""
    code = status.get("code")
    message, reason = _text(status.get("message", "")), _text(status.get("reason", "") or "")
    if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) <= 3:
        code = int(code)
    if not isinstance(code, int) or isinstance(code, bool):
        return KubeError(0, f"a watch ERROR event whose Status code is {_text(code)[:40]!r}: {message}", reason)
    return (Gone if code == 410 else KubeError)(code, message, reason)


def _text(value: object) -> str:
    # A Status field that is no scalar is named by its type: str() of a deeply nested value recurses.
    if value is None or isinstance(value, str | int | float | bool):
        return str(value)
    return f"<{type(value).__name__}>"
