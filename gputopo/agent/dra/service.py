"""The gRPC services of the DRA driver: DRAPlugin v1 and v1beta1 over one `DraDriver`, and Registration.

v1 and v1beta1 carry the same messages in different proto packages, so one adapter class serves both,
given the version's generated module. Registration answers the kubelet's plugin watcher: type
`DRAPlugin`, the driver's name, the DRA socket as endpoint, and the services served, newest first.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gputopo.agent.dra.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from gputopo.agent.dra.driver import ClaimRef, DraDriver

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # pluginregistration v1's DRAPlugin constant
# "<proto package's last element>.<service>", as the kubelet matches them; newest first.
SERVICE_V1 = "v1.DRAPlugin"
SERVICE_V1BETA1 = "v1beta1.DRAPlugin"
SUPPORTED_SERVICES = (SERVICE_V1, SERVICE_V1BETA1)


def _refs(claims: Any) -> list[ClaimRef]:
    return [ClaimRef(uid=str(c.uid), namespace=str(c.namespace), name=str(c.name)) for c in claims]


class DraPluginServicer:
    """NodePrepareResources / NodeUnprepareResources for one API version (`pb` is its *_pb2 module)."""

    def __init__(self, driver: DraDriver, pb: ModuleType) -> None:
        self._driver = driver
        self._pb = pb

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        pb = self._pb
        results = self._driver.prepare(_refs(request.claims))
        out = {}
        for uid, r in results.items():
            if r.error:
                out[uid] = pb.NodePrepareResourceResponse(error=r.error)
                continue
            devices = [
                pb.Device(
                    request_names=list(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=list(d.cdi_device_ids),
                )
                for d in r.devices
            ]
            out[uid] = pb.NodePrepareResourceResponse(devices=devices)
        return pb.NodePrepareResourcesResponse(claims=out)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        pb = self._pb
        errors = self._driver.unprepare(_refs(request.claims))
        return pb.NodeUnprepareResourcesResponse(
            claims={uid: pb.NodeUnprepareResourceResponse(error=err) for uid, err in errors.items()}
        )


def add_dra_services(driver: DraDriver, server: Any) -> None:
    """Both API versions of the DRAPlugin service on `server`."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(driver, dra_v1_pb2), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(driver, dra_v1beta1_pb2), server)


class RegistrationServicer(pluginregistration_pb2_grpc.RegistrationServicer):  # type: ignore[misc]
    """What the kubelet's plugin watcher asks of the registration socket."""

    def __init__(
        self,
        driver_name: str,
        endpoint: str,
        on_status: Callable[[bool, str], None] | None = None,
        services: tuple[str, ...] = SUPPORTED_SERVICES,
    ) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.services = services
        self._on_status = on_status
        self._lock = threading.Lock()
        self.registered = False
        self.last_error = ""
        self.notifications = 0

    def GetInfo(self, request: Any, context: Any) -> Any:
        return pluginregistration_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver_name, endpoint=self.endpoint, supported_versions=list(self.services)
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        ok, error = bool(request.plugin_registered), str(request.error)
        with self._lock:
            self.registered, self.last_error = ok, error
            self.notifications += 1
        if ok:
            log.info("registered with the kubelet as a DRA driver", extra={"driver": self.driver_name})
        else:
            log.error("the kubelet refused the DRA driver's registration", extra={"error": error})
        if self._on_status is not None:
            try:
                self._on_status(ok, error)
            except Exception:
                log.exception("registration status callback failed")
        return pluginregistration_pb2.RegistrationStatusResponse()
