"""FastAPI dependencies of the webhook and metrics apps: settings, service and metrics live on `app.state`
(set by `gputopo.extender.app.create_listeners`)."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from gputopo.extender.metrics import Metrics
from gputopo.extender.verbs.service import Extender


def get_extender(request: Request) -> Extender:
    return cast(Extender, request.app.state.extender)


def get_metrics(request: Request) -> Metrics:
    return cast(Metrics, request.app.state.metrics)


ExtenderDep = Annotated[Extender, Depends(get_extender)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
