"""FastAPI dependencies: the app's settings, service and metrics live on `app.state` (set by create_app)."""

from __future__ import annotations

from typing import Annotated, cast

from fastapi import Depends, Request

from extender.metrics import Metrics
from extender.service import Extender
from extender.settings import Settings


def get_settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


def get_extender(request: Request) -> Extender:
    return cast(Extender, request.app.state.extender)


def get_metrics(request: Request) -> Metrics:
    return cast(Metrics, request.app.state.metrics)


SettingsDep = Annotated[Settings, Depends(get_settings)]
ExtenderDep = Annotated[Extender, Depends(get_extender)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
