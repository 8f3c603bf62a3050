"""Feature gates and runtime-config for the local control plane: checked once, then rendered as flags.

``ControlPlane(features=ApiFeatures(feature_gates=..., runtime_config=...))`` takes them as mappings;
the e2e suite reads them from ``GPUTOPO_E2E_FEATURE_GATES`` and ``GPUTOPO_E2E_RUNTIME_CONFIG``
(``Name=true,Other=false``, ``api/beta=true``) through ``parse_flag_map``. Bad input is refused with an
error naming it, before any process starts: an upstream binary would only say so in its log.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "ApiFeatures",
    "FlagError",
    "feature_gates_arg",
    "parse_flag_map",
    "runtime_config_arg",
]

# Upstream gate names are CamelCase identifiers (component-base/featuregate).
_GATE = re.compile(r"[A-Z][A-Za-z0-9]*")
# --runtime-config keys: api/all, api/ga, api/beta, api/alpha, <group>/<version> (the core group is
# "v1" or "api/v1"), or <group>/<version>/<resource>.
_API = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(/[a-z0-9]([a-z0-9.-]*[a-z0-9])?){0,2}")
_BOOL = {"true": True, "false": False}


class FlagError(ValueError):
    """A feature gate or runtime-config entry that the control plane refuses."""


@dataclass(frozen=True, kw_only=True)
class ApiFeatures:
    """What the control plane serves beyond its defaults: `feature_gates` (kube-apiserver, every
    kube-scheduler and kube-controller-manager), `runtime_config` (kube-apiserver only), and the
    ServiceAccount admission plugin, as every real cluster runs it (pods then get their account's token
    volume; a pod's ServiceAccount must exist before the pod)."""

    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    runtime_config: Mapping[str, bool] = field(default_factory=dict)
    service_account_admission: bool = False


DEFAULT_FEATURES = ApiFeatures()


def parse_flag_map(text: str, *, source: str) -> dict[str, bool]:
    """``"A=true,B=false"`` -> ``{"A": True, "B": False}``. ``source`` names the input in errors (an
    environment variable, an option). Empty text is an empty map; a repeated key is an error."""
    out: dict[str, bool] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not sep or not key or value not in _BOOL:
            raise FlagError(f"{source}: {item!r} is not NAME=true or NAME=false")
        if key in out:
            raise FlagError(f"{source}: {key!r} is given twice")
        out[key] = _BOOL[value]
    return out


def _render(values: Mapping[str, bool], pattern: re.Pattern[str], what: str) -> str:
    parts = []
    for key in sorted(values):
        value = values[key]
        if not isinstance(key, str) or not pattern.fullmatch(key):
            raise FlagError(f"{what}: {key!r} is not a valid name")
        if not isinstance(value, bool):
            raise FlagError(f"{what}: {key}={value!r} must be true or false")
        parts.append(f"{key}={'true' if value else 'false'}")
    return ",".join(parts)


def feature_gates_arg(gates: Mapping[str, bool]) -> str:
    """The value of ``--feature-gates`` (sorted, so that a log line compares between runs)."""
    return _render(gates, _GATE, "feature gate")


def runtime_config_arg(config: Mapping[str, bool]) -> str:
    """The value of kube-apiserver's ``--runtime-config``."""
    return _render(config, _API, "runtime-config")
