"""Kubernetes quantities in pod annotations (`80Gi`, `500m`), parsed exactly and with bounded work."""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

# Kubernetes quantities (resource.Quantity's grammar): a signed decimal, then a binary suffix (Ki..Ei), a
# decimal suffix (n, u, m, k, M..E) or an exponent (e3). The shape and length are checked first, so no
# value (400 digits, NaN, inf, 1e999999) costs real work; the Kubernetes client's parser then gives the
# exact Decimal, and anything beyond int64 (how the API server and kubelet account resources) is refused.
MAX_QUANTITY_CHARS = 64
MAX_QUANTITY = 2**63 - 1
_QUANTITY = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,3})?$")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (`2`, `500m`, `80Gi`, `1e3`) as an exact Decimal, finite and within ±(2^63-1).

    Raises ValueError saying why; the work is bounded whatever the input."""
    if len(text) > MAX_QUANTITY_CHARS:
        raise ValueError(f"not a Kubernetes quantity: longer than {MAX_QUANTITY_CHARS} characters")
    stripped = text.strip()
    if not _QUANTITY.fullmatch(stripped):
        raise ValueError("not a Kubernetes quantity such as 2, 500m or 80Gi")
    # Imported here: the client package takes ~0.2 s to import, and most CLI commands never parse one.
    from kubernetes.utils.quantity import parse_quantity as parse_k8s_quantity

    value = parse_k8s_quantity(stripped)
    if not isinstance(value, Decimal) or not value.is_finite() or abs(value) > MAX_QUANTITY:
        raise ValueError(f"out of range: a Kubernetes quantity is at most {MAX_QUANTITY}")
    return value


def parse_quantity_bytes(text: str) -> int:
    """Kubernetes quantity (`80Gi`, `100G`, `81920Mi`) to whole bytes, rounded up as Kubernetes does;
    ValueError (saying why) otherwise, negative amounts included."""
    value = parse_quantity(text)
    if value < 0:
        raise ValueError("must not be negative")
    return int(value.to_integral_value(rounding=ROUND_CEILING))


def format_mib(mib: int) -> str:
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
