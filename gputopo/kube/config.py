"""Which kubeconfig to use, and the `kubernetes` client configuration built from it (or in-cluster)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def find_kubeconfig(explicit: str | Path | None) -> Path | None:
    """The kubeconfig to use: `explicit`, else the first of $KUBECONFIG, else ~/.kube/config when it
    exists; None means in-cluster configuration."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if env:
        return Path(env)
    home = Path.home() / ".kube" / "config"
    return home if home.exists() else None


def client_configuration(kubeconfig: str | Path | None, *, pool_size: int = 64) -> Any:
    """A `kubernetes.client.Configuration` from this kubeconfig file, or in-cluster when None."""
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg: Any = k8s_client.Configuration()
    if kubeconfig is not None:
        k8s_config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    else:
        k8s_config.load_incluster_config(client_configuration=cfg)
    # The extender binds on many server threads at once, each making several calls: a smaller pool
    # discards connections under load, and every new one costs a TLS handshake on both sides.
    cfg.connection_pool_maxsize = pool_size
    # The kubeconfig loader's refresh hook re-assigns `host` before every request, and the client
    # then re-reads the proxy settings from the whole environment each time. Pin the proxy it
    # resolved at start-up (the same value) so requests skip that scan.
    cfg.proxy = cfg.proxy
    return cfg
