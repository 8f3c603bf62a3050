"""`gputopo-extender`: command-line flags and GPUTOPO_* environment variables (docs/configuration.md), then
uvicorn. Flags win over the environment."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gputopo.clusterfile import ClusterFileError
from gputopo.jsonlog import configure_logging


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gputopo-extender",
        description="Topology-aware kube-scheduler extender (filter, prioritize, bind, preempt).",
        epilog="Every flag is also an environment variable: --stale-after-seconds is GPUTOPO_STALE_AFTER_SECONDS. "
        "GPUTOPO_SCORE_WEIGHTS (JSON) sets the score weights.",
    )
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8888)")
    p.add_argument("--tls-cert-file", type=Path, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key-file", type=Path, help="private key for --tls-cert-file")
    p.add_argument("--kubeconfig", type=Path, help="kubeconfig to reach the API server (default: in-cluster)")
    p.add_argument("--namespace", help="namespace of the agents' Leases (default gputopo-system)")
    p.add_argument("--stale-after-seconds", type=float, help="a node whose agent Lease is older is stale (120)")
    p.add_argument("--reservation-timeout-seconds", type=float, help="unbound group reservations expire (120)")
    p.add_argument("--snapshot", type=Path, help="serve from a static cluster file, no API server")
    p.add_argument(
        "--max-request-bytes", type=int, help="larger request bodies get HTTP 413 unparsed (default 8388608, 8 MiB)"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"], help="(default info)")
    return p.parse_args(argv)


def load_settings(argv: Sequence[str] | None = None) -> Any:
    from extender.settings import Settings

    args = parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if v is not None}
    return Settings(**flags)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except ValidationError as e:
        print(f"gputopo-extender: invalid settings: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    import uvicorn

    from extender.app import create_app

    try:
        app = create_app(settings)
    except ClusterFileError as e:
        print(f"gputopo-extender: {e}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=str(settings.tls_cert_file) if settings.tls_cert_file else None,
        ssl_keyfile=str(settings.tls_key_file) if settings.tls_key_file else None,
        log_config=None,
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
