"""The one builder of API server paths and of the names in their queries: every path the extender, the
agent and the clients send is made here, from parts checked as Kubernetes checks them
(gputopo.model.k8snames: a namespace is a DNS-1123 label, an object name a DNS-1123 subdomain) and then
percent-escaped. A part that fails raises InvalidName (a ValueError naming the part) before any request:
a forged namespace such as `x/resourceclaims?watch=1` never becomes another path."""

from __future__ import annotations

from urllib.parse import quote

from gputopo.model.k8snames import InvalidName, check_name, check_namespace

__all__ = ["InvalidName", "api_path", "field_selector"]

_SUBRESOURCES = frozenset({"", "binding", "status"})


def api_path(
    group: str,
    version: str,
    resource: str,
    namespace: str | None = None,
    name: str = "",
    subresource: str = "",
) -> str:
    """`/api/<version>` (core) or `/apis/<group>/<version>`, then `namespaces/<namespace>` when given,
    `<resource>`, `<name>` when given and `<subresource>` (binding, status) when given."""
    if subresource not in _SUBRESOURCES:
        raise InvalidName(f"subresource {subresource!r} is not one gputopo uses")
    if subresource and not name:
        raise InvalidName(f"subresource {subresource!r} needs an object name")
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace:
        base += "/namespaces/" + quote(check_namespace(namespace), safe="")
    base += "/" + resource
    if name:
        base += "/" + quote(check_name(name, f"{resource} name"), safe="")
    return base + ("/" + subresource if subresource else "")


def field_selector(field: str, value: str) -> str:
    """`field=value` for a field selector on an object name (`spec.nodeName`), the name checked: a value
    holding `,` or `!=` would add terms of its own."""
    return f"{field}={check_name(value, field)}"
