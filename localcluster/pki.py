"""Credential files of the local control plane: service-account signing keys and kubeconfigs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from .procs import ControlPlaneError


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
