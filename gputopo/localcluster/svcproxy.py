"""The one piece of kube-proxy a containerd node of the local control plane needs: the
``kubernetes`` Service, forwarded to kube-apiserver.

Pods that containers run in reach the API server the in-cluster way: ``KUBERNETES_SERVICE_HOST``
and ``_PORT`` (the ``kubernetes`` Service's cluster IP, which the serving certificate names) and
the mounted service-account token. No kube-proxy runs here and kube-apiserver listens on loopback,
so ``ContainerdNode`` gives the cluster IP to an interface of its own and runs this forwarder
on it, as a component of the control plane::

    python -m gputopo.localcluster.svcproxy LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT

It copies bytes both ways (TLS goes end to end, between the pod and kube-apiserver); one
connection's failure closes only that connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

USAGE = "usage: python -m gputopo.localcluster.svcproxy LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT\n"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def serve(listen_host: str, listen_port: int, target_host: str, target_port: int) -> None:
    """Accept on ``listen_host:listen_port`` and forward each connection, until cancelled."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, target_w), _pipe(target_r, client_w))

    server = await asyncio.start_server(handle, listen_host, listen_port, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or not args[1].isdigit() or not args[3].isdigit():
        sys.stderr.write(USAGE)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args[0], int(args[1]), args[2], int(args[3])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
