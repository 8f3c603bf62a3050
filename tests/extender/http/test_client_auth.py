"""Who may call /mutate: with --webhook-client-ca-file only a client whose certificate that CA signed and
that names one of --webhook-client-names (the API server), over the real webhook listener and real TLS;
everyone else gets 401 or 403 with a JSON body saying why, or no handshake at all. /healthz stays open to
the kubelet's probes, which carry no certificate."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.extender.app import create_listeners
from gputopo.extender.http.clientauth import ClientAuth, certificate_names
from gputopo.extender.settings import Settings
from tests.extender.harness import certificate, gputopo_pod, serving

CLUSTER = "nodes:\n  - {name: h1, fixture: dgx-h100}\n"
REVIEW = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": gputopo_pod("p", 1)},
}
ALLOWED = "kube-apiserver-webhook-client"
WEBHOOK: dict[str, Any] = {"webhook_port": 8443, "tls_cert_file": Path("c"), "tls_key_file": Path("k")}


def _openssl(tmp: Path, *args: str) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not found")
    subprocess.run([openssl, *args], check=True, capture_output=True, cwd=tmp)


def _ca(tmp: Path, name: str) -> tuple[Path, Path]:
    crt, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    _openssl(tmp, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(crt))  # fmt: skip
    return crt, key


def _client_cert(tmp: Path, ca: tuple[Path, Path], name: str, cn: str, san: str = "") -> tuple[Path, Path]:
    crt, key, csr, ext = (tmp / f"{name}{s}" for s in (".crt", ".key", ".csr", ".ext"))
    ext.write_text("extendedKeyUsage=clientAuth\n" + (f"subjectAltName={san}\n" if san else ""))
    _openssl(tmp, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/O=system:masters/CN={cn}",
             "-keyout", str(key), "-out", str(csr))  # fmt: skip
    _openssl(tmp, "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-out", str(crt), "-extfile", str(ext))  # fmt: skip
    return crt, key


@dataclass
class Running:
    port: int
    server_ca: Path
    certs: dict[str, tuple[Path, Path]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("webhook-auth")
    server_ca, crt, key = certificate(tmp)
    client_ca = _ca(tmp, "client-ca")
    other_ca = _ca(tmp, "other-ca")
    certs = {
        "api server (CN)": _client_cert(tmp, client_ca, "apiserver", ALLOWED),
        "api server (SAN)": _client_cert(tmp, client_ca, "apiserver-san", "something-else", f"DNS:{ALLOWED}"),
        "same CA, another name": _client_cert(tmp, client_ca, "mallory", "mallory", "DNS:mallory.example"),
        "another CA, the allowed name": _client_cert(tmp, other_ca, "forger", ALLOWED),
    }
    (tmp / "cluster.yaml").write_text(CLUSTER)
    port = _free_port()
    settings = Settings(
        snapshot=tmp / "cluster.yaml",
        port=_free_port(),
        webhook_host="127.0.0.1",
        webhook_port=port,
        tls_cert_file=crt,
        tls_key_file=key,
        webhook_client_ca_file=client_ca[0],
        webhook_client_names=f"{ALLOWED}, other-name",
        metrics_port=0,
        log_level="critical",
    )
    r = Running(port, server_ca, certs)
    with serving(settings, lambda: _call(r, "GET", "/healthz")[0] == 200, "the webhook listener"):
        yield r


def _call(r: Running, method: str, path: str, cert: str | None = None) -> tuple[int, dict[str, Any]]:
    """One request over a fresh TLS connection, written and read on the socket: (status, JSON body)."""
    context = ssl.create_default_context(cafile=str(r.server_ca))
    if cert is not None:
        context.load_cert_chain(*map(str, r.certs[cert]))
    body = json.dumps(REVIEW).encode() if method == "POST" else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    with (
        socket.create_connection(("127.0.0.1", r.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(head.encode() + body)
        chunks = []
        while chunk := tls.recv(65536):
            chunks.append(chunk)
    data = b"".join(chunks)
    if not data:
        raise ConnectionResetError("the server closed the connection without an answer")
    status_line, _, rest = data.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload) if payload else {}


@pytest.mark.parametrize(
    ("cert", "status", "words"),
    [
        pytest.param(None, 401, "client certificate", id="forged review without a certificate: 401"),
        pytest.param("same CA, another name", 403, "mallory", id="the CA's other certificates: 403 naming them"),
        pytest.param("api server (CN)", 200, "", id="the API server by CN: answered"),
        pytest.param("api server (SAN)", 200, "", id="the API server by subjectAltName: answered"),
    ],
)
def test_mutate_answers_only_the_api_servers_certificate(
    running: Running, cert: str | None, status: int, words: str
) -> None:
    got, body = _call(running, "POST", "/mutate", cert)
    assert got == status, body
    if status == 200:
        assert body["response"]["uid"] == "u-1" and body["response"]["allowed"] is True
    else:
        assert words in body["Error"] and "response" not in body


def test_a_certificate_another_ca_signed_gets_no_handshake(running: Running) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _call(running, "POST", "/mutate", "another CA, the allowed name")


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_probes_need_no_certificate(running: Running, path: str) -> None:
    assert _call(running, "GET", path)[0] == 200


# --------------------------------------------------------------------------------------------------
# the names a certificate carries; the settings


def test_certificate_names_reads_cn_and_subject_alt_names(running: Running) -> None:
    def der(name: str) -> bytes:
        return ssl.PEM_cert_to_DER_cert(running.certs[name][0].read_text())

    assert certificate_names(der("api server (CN)")) == (ALLOWED,)
    assert certificate_names(der("same CA, another name")) == ("mallory", "mallory.example")


@given(data=st.binary(max_size=512))
def test_bytes_that_are_no_certificate_name_no_one(data: bytes) -> None:
    assert isinstance(certificate_names(data), tuple)
    assert ClientAuth.of(["x"]).refusal({"extensions": {"tls": {"client_cert_chain": ["not pem"]}}}) is not None


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        pytest.param(
            {"webhook_client_ca_file": Path("ca.crt")}, "--webhook-port", id="a client CA without the webhook"
        ),
        pytest.param(
            {**WEBHOOK, "webhook_client_ca_file": Path("ca.crt")},
            "--webhook-client-names",
            id="a client CA without names would let in every certificate it signed",
        ),
        pytest.param({"webhook_client_names": "kube-apiserver"}, "--webhook-client-ca-file", id="names without a CA"),
    ],
)
def test_client_auth_settings_that_cannot_work_are_refused_naming_the_flag(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Settings(**kw)


@pytest.mark.parametrize(
    ("client_auth", "warned"),
    [pytest.param(False, True, id="no client CA: a warning at start"), pytest.param(True, False, id="client CA: none")],
)
def test_an_unauthenticated_webhook_is_said_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, client_auth: bool, warned: bool
) -> None:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    auth: dict[str, Any] = {"webhook_client_ca_file": Path("ca.crt"), "webhook_client_names": ALLOWED}
    settings = Settings(snapshot=tmp_path / "cluster.yaml", **WEBHOOK, **(auth if client_auth else {}))
    with caplog.at_level("WARNING", logger="gputopo.extender"), create_listeners(settings).running():
        pass
    assert any("webhook is unauthenticated" in r.getMessage() for r in caplog.records) == warned
