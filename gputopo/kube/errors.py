"""The access layer's errors: every failed call, whatever its cause, is a `KubeError`; 410 is `Gone`."""

from __future__ import annotations

import json


class KubeError(RuntimeError):
    """A non-2xx answer from the API server, or none at all (status 0: refused, TLS, timeout).

    `reason` and `message` come from the Status body when there is one; `method` and `path` name the
    request when it is known (a watch ERROR event has neither)."""

    def __init__(
        self, status: int, message: str, reason: str = "", *, method: str = "", path: str = "", body: str = ""
    ) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.method = method
        self.path = path
        self.body = body
        text = f"{status} {reason}: {message}" if reason else f"{status}: {message}"
        super().__init__(f"{method} {path}: {text}" if method else text)


class Gone(KubeError):
    """410 Gone: the resourceVersion a watch started from was compacted away; relist."""


def status_error(status: int, body: bytes | str, *, method: str = "", path: str = "") -> KubeError:
    """The error for a non-2xx answer: reason and message parsed from a Status body, `Gone` for 410."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    reason, message = "", text
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        reason = str(doc.get("reason", "") or "")
        message = str(doc.get("message", text))
    cls = Gone if status == 410 else KubeError
    return cls(status, message, reason, method=method, path=path, body=text)
