"""Who may call the webhook's /mutate: the API server, recognised by its client certificate.

With `--webhook-client-ca-file` the webhook listener's TLS context asks every client for a certificate
(optional, so the kubelet's probes of /healthz still connect without one) and the handshake fails for a
certificate that CA did not sign. The listener passes the verified certificate to the app in the ASGI
TLS extension (`scope["extensions"]["tls"]["client_cert_chain"]`, PEM, the leaf first). /mutate then
answers only a caller whose certificate names one of `--webhook-client-names`, as its subject's CN or a
subjectAltName (DNS, URI or e-mail): 401 without a certificate, 403 with one naming someone else, each
with a JSON body saying why.

The names are read from the certificate's DER here (the standard library's `ssl` reads them only from a
live connection, and the ASGI extension carries the certificate, not the connection): a small reader of
the few X.509 fields involved. The certificate was verified by OpenSSL before it got here, so this never
decides whether it is genuine, only whom it names; anything it cannot read names no one.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ClientAuth", "certificate_names", "peer_certificate"]

_CN = bytes.fromhex("550403")  # 2.5.4.3 commonName
_SAN = bytes.fromhex("551d11")  # 2.5.29.17 subjectAltName
_SAN_TAGS = {0x81, 0x82, 0x86}  # rfc822Name, dNSName, uniformResourceIdentifier (context-specific, primitive)


class _Malformed(ValueError):
    pass


def _tlv(data: bytes, i: int, end: int) -> tuple[int, int, int]:
    """(tag, start of the value, end of the value) of the DER element at `i`, within `end`."""
    if i + 2 > end:
        raise _Malformed("truncated")
    tag, first = data[i], data[i + 1]
    i += 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if not 1 <= n <= 4 or i + n > end:
            raise _Malformed("bad length")
        length = int.from_bytes(data[i : i + n], "big")
        i += n
    if i + length > end:
        raise _Malformed("truncated value")
    return tag, i, i + length


def _children(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    i = start
    while i < end:
        tag, s, e = _tlv(data, i, end)
        yield tag, s, e
        i = e


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def certificate_names(der: bytes) -> tuple[str, ...]:
    """The subject's CNs, then the subjectAltName DNS names, URIs and e-mail addresses of an X.509
    certificate in DER; () for bytes that are not one."""
    try:
        return tuple(_names(der))
    except (_Malformed, IndexError):
        return ()


def _names(der: bytes) -> Iterator[str]:
    tag, s, e = _tlv(der, 0, len(der))
    if tag != 0x30:
        raise _Malformed("not a certificate")
    tag, s, e = _tlv(der, s, e)  # tbsCertificate
    if tag != 0x30:
        raise _Malformed("no tbsCertificate")
    fields = list(_children(der, s, e))
    if fields and fields[0][0] == 0xA0:  # [0] version
        fields = fields[1:]
    # serialNumber, signature, issuer, validity, subject, subjectPublicKeyInfo, then [1] [2] [3]
    if len(fields) < 6:
        raise _Malformed("short tbsCertificate")
    _, ss, se = fields[4]
    for _, rs, re_ in _children(der, ss, se):  # RelativeDistinguishedName (SET)
        for _, as_, ae in _children(der, rs, re_):  # AttributeTypeAndValue (SEQUENCE)
            parts = list(_children(der, as_, ae))
            if len(parts) == 2 and parts[0][0] == 0x06 and der[parts[0][1] : parts[0][2]] == _CN:
                yield _text(der[parts[1][1] : parts[1][2]])
    for tag, xs, xe in fields[6:]:
        if tag != 0xA3:  # [3] extensions
            continue
        (_, ls, le), *_ = _children(der, xs, xe)
        for _, es, ee in _children(der, ls, le):  # Extension
            parts = list(_children(der, es, ee))
            if not parts or parts[0][0] != 0x06 or der[parts[0][1] : parts[0][2]] != _SAN:
                continue
            otag, os_, oe = parts[-1]
            if otag != 0x04:
                raise _Malformed("subjectAltName is not an OCTET STRING")
            _, gs, ge = _tlv(der, os_, oe)
            for gtag, vs, ve in _children(der, gs, ge):
                if gtag in _SAN_TAGS:
                    yield _text(der[vs:ve])


def _pem_to_der(pem: str) -> bytes:
    body = "".join(line for line in pem.strip().splitlines() if line and not line.startswith("-----"))
    return base64.b64decode(body, validate=False)


def peer_certificate(scope: Mapping[str, Any]) -> bytes | None:
    """The client's certificate (DER) from the ASGI TLS extension; None when it presented none."""
    extensions = scope.get("extensions")
    tls = extensions.get("tls") if isinstance(extensions, Mapping) else None
    chain = tls.get("client_cert_chain") if isinstance(tls, Mapping) else None
    if not isinstance(chain, list) or not chain or not isinstance(chain[0], str):
        return None
    try:
        return _pem_to_der(chain[0])
    except ValueError:
        return None


@dataclass(frozen=True)
class ClientAuth:
    """The names a verified client certificate must carry (one of them) to call /mutate."""

    names: frozenset[str]

    @classmethod
    def of(cls, names: Iterable[str]) -> ClientAuth:
        return cls(frozenset(names))

    def refusal(self, scope: Mapping[str, Any]) -> tuple[int, str] | None:
        """(status, why) for a caller that may not call /mutate; None for one that may."""
        der = peer_certificate(scope)
        if der is None:
            return 401, (
                "the webhook answers only the API server: present a client certificate signed by the CA of "
                "--webhook-client-ca-file (the API server's --admission-control-config-file kubeconfig)"
            )
        presented = certificate_names(der)
        if self.names.intersection(presented):
            return None
        shown = ", ".join(sorted(set(presented))[:5]) or "no name"
        allowed = ", ".join(sorted(self.names))
        return 403, f"the client certificate names {shown}; --webhook-client-names allows {allowed}"
