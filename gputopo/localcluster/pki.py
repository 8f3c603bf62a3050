"""Credential files of the local control plane: service-account signing keys, kubeconfigs, and the client
certificate kube-apiserver presents to admission webhooks (with the admission configuration naming it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gputopo.localcluster.procs import ControlPlaneError


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def generate_sa_keys(key: Path, pub: Path) -> None:
    """RSA key pair for signing service-account tokens: openssl CLI, else ``cryptography``."""
    openssl = shutil.which("openssl")
    if openssl:
        subprocess.run(
            [openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key)],
            check=True,
            capture_output=True,
        )
        subprocess.run([openssl, "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True)
        key.chmod(0o600)
        return
    try:
        import importlib

        rsa: Any = importlib.import_module("cryptography.hazmat.primitives.asymmetric.rsa")
        ser: Any = importlib.import_module("cryptography.hazmat.primitives.serialization")
    except ImportError as e:
        raise ControlPlaneError(
            "need the openssl command or the Python 'cryptography' package to create service-account signing keys"
        ) from e
    k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    write_private(
        key,
        k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()).decode(),
    )
    pub.write_bytes(k.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))


def kubeconfig_text(server: str, *, token: str, user: str, ca_file: Path | None, cluster: str = "gputopo-local") -> str:
    """A kubeconfig (JSON, which is YAML) for one bearer token."""
    cl: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cl["certificate-authority"] = str(ca_file)
    else:
        cl["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": cl}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": f"{user}@{cluster}", "context": {"cluster": cluster, "user": user}}],
        "current-context": f"{user}@{cluster}",
        "preferences": {},
    }
    return json.dumps(doc, indent=2) + "\n"


def _signed_by_new_ca(
    directory: Path, *, ca_cn: str, cn: str, stem: str, extension: str, purpose: str
) -> tuple[Path, Path, Path]:
    """A throwaway CA (CN `ca_cn`) and a certificate it signed (CN `cn`, the openssl `extension` line), in
    `directory`: (ca.crt, <stem>.crt, <stem>.key). Needs the openssl command (`purpose` says what for)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError(f"need the openssl command to create {purpose}")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, crt, ext = (
        directory / n for n in ("ca.key", "ca.crt", f"{stem}.key", f"{stem}.csr", f"{stem}.crt", f"{stem}.ext")
    )
    ext.write_text(extension + "\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={ca_cn}",
         "-keyout", ca_key, "-out", ca],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", key, "-out", csr],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-out", crt,
         "-extfile", ext],
    ]  # fmt: skip
    for argv in steps:
        subprocess.run([openssl, *map(str, argv)], check=True, capture_output=True)
    for private in (ca_key, key):
        private.chmod(0o600)
    return ca, crt, key


def generate_client_certificate(directory: Path, common_name: str) -> tuple[Path, Path, Path]:
    """A throwaway CA and a client certificate (CN `common_name`, clientAuth) it signed, in `directory`:
    (ca.crt, client.crt, client.key). Needs the openssl command."""
    return _signed_by_new_ca(
        directory,
        ca_cn="gputopo-local-webhook-client-ca",
        cn=common_name,
        stem="client",
        extension="extendedKeyUsage=clientAuth",
        purpose="the API server's webhook client certificate",
    )


def admission_configuration(webhook_kubeconfig: Path) -> str:
    """kube-apiserver's --admission-control-config-file: both webhook admission plugins call webhooks with
    the credentials of `webhook_kubeconfig`. The kind is WebhookAdmissionConfiguration: kube-apiserver
    (1.34) refuses the `WebhookAdmission` that the config-API reference names."""
    webhook = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
               "kubeConfigFile": str(webhook_kubeconfig)}  # fmt: skip
    doc = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [
            {"name": "ValidatingAdmissionWebhook", "configuration": webhook},
            {"name": "MutatingAdmissionWebhook", "configuration": webhook},
        ],
    }
    return json.dumps(doc, indent=2) + "\n"


def webhook_client_kubeconfig(crt: Path, key: Path) -> str:
    """The kubeconfig whose user `*` (every webhook) carries the client certificate kube-apiserver presents."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "users": [{"name": "*", "user": {"client-certificate": str(crt), "client-key": str(key)}}],
    }
    return json.dumps(doc, indent=2) + "\n"


def generate_serving_certificate(directory: Path, common_name: str) -> tuple[Path, Path, Path]:
    """A throwaway CA and a serving certificate for 127.0.0.1 and localhost (CN `common_name`) it signed,
    in `directory`: (ca.crt, tls.crt, tls.key), the names controller-runtime's webhook servers read.
    Needs the openssl command."""
    return _signed_by_new_ca(
        directory,
        ca_cn="gputopo-local-ca",
        cn=common_name,
        stem="tls",
        extension="subjectAltName=IP:127.0.0.1,DNS:localhost",
        purpose="a webhook serving certificate",
    )
