"""Settings of gputopo-extender (docs/configuration.md): every flag is also a GPUTOPO_* environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from extender.limits import DEFAULT_MAX_REQUEST_BYTES
from gputopo.engine.scoring import ScoreWeights
from gputopo.tiers import DEFAULT_TIERS, TierConfig

LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class Settings(BaseSettings):
    """The extender's configuration. Flags win over environment variables (main.py passes them as init values)."""

    model_config = SettingsConfigDict(env_prefix="GPUTOPO_", extra="ignore", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(8888, ge=0, le=65535)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    kubeconfig: Path | None = None  # unset: in-cluster configuration
    namespace: str = "gputopo-system"
    stale_after_seconds: float = Field(120.0, gt=0)
    reservation_timeout_seconds: float = Field(120.0, gt=0)
    snapshot: Path | None = None
    log_level: LogLevel = "info"
    # Larger request bodies get 413 before they are parsed (extender/limits.py sizes the default).
    max_request_bytes: int = Field(DEFAULT_MAX_REQUEST_BYTES, ge=64 * 1024, le=1024**3)
    # Environment only (JSON): GPUTOPO_SCORE_WEIGHTS, and GPUTOPO_TIERS as the chart passes it.
    score_weights: ScoreWeights = ScoreWeights()
    tiers: TierConfig = DEFAULT_TIERS

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file must be given together")
        return self
