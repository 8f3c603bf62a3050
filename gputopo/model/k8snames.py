"""Names, integers and times as the API server reads them: what every part checks before a name goes into an API
path or query, and before an integer in an annotation or label is used.

- a namespace is a DNS-1123 label (lower-case letters, digits and `-`, at most 63, starting and ending
  alphanumeric); most object names (nodes, pods, leases, DRA objects, Jobs) are DNS-1123 subdomains
  (labels joined by `.`, at most 253). So `..`, `/`, `%2F`, `?`, `#`, upper case, spaces and non-ASCII
  never reach a path.
- an integer in an annotation or label is ASCII digits only, without sign, `_` or spaces, within stated
  bounds (what `int()` would also take, `٤`, `1_0`, `+4`, ` 4 `, is refused).
- a time (creationTimestamp, a Lease's renewTime) is RFC 3339 with its zone (`parse_time`).
"""

from __future__ import annotations

import re
from datetime import datetime

MAX_LABEL = 63
MAX_SUBDOMAIN = 253
_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
MAX_INT_DIGITS = 10  # past every bound the project uses; int() of a longer string is never tried
# ASCII digits only: the class names them (`\d` and str.isdigit() would take any script's digits).
_DIGITS = re.compile(rf"[0-9]{{1,{MAX_INT_DIGITS}}}")


class InvalidName(ValueError):
    """A namespace or object name Kubernetes would refuse; the message names what it is and the value."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:76] + "…'"


def is_dns1123_label(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL and _LABEL.fullmatch(value) is not None


def is_dns1123_subdomain(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_SUBDOMAIN and _SUBDOMAIN.fullmatch(value) is not None


def check_namespace(value: object, what: str = "namespace") -> str:
    """`value` when it is a DNS-1123 label; InvalidName naming `what` otherwise."""
    if not is_dns1123_label(value):
        raise InvalidName(
            f"{what} {_shown(value)} is not a DNS-1123 label (lower-case letters, digits and '-', "
            f"at most {MAX_LABEL}, starting and ending with a letter or digit)"
        )
    assert isinstance(value, str)
    return value


def check_name(value: object, what: str = "name") -> str:
    """`value` when it is a DNS-1123 subdomain; InvalidName naming `what` otherwise."""
    if not is_dns1123_subdomain(value):
        raise InvalidName(
            f"{what} {_shown(value)} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.', "
            f"at most {MAX_SUBDOMAIN}, each part starting and ending with a letter or digit)"
        )
    assert isinstance(value, str)
    return value


def ascii_int(value: str, lo: int, hi: int) -> int | None:
    """`value` as an integer from `lo` to `hi` when it is ASCII digits only (no sign, `_` or spaces);
    None otherwise. Never calls int() on more than MAX_INT_DIGITS characters."""
    if not isinstance(value, str) or not _DIGITS.fullmatch(value):
        return None
    n = int(value)
    return n if lo <= n <= hi else None


def parse_time(text: object) -> float | None:
    """An RFC 3339 time of an API object (a Lease's renewTime, a creationTimestamp, a condition's
    lastHeartbeatTime; with or without fractions) in epoch seconds; None for anything else, a time
    without its zone included (read as local time it would be off by the machine's offset)."""
    if not isinstance(text, str):
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None
