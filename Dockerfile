# syntax=docker/dockerfile:1
# One image for gputopo-extender and gputopo-agent; the command chooses which runs
# (the Helm chart sets `command: ["gputopo-extender"]` or `["gputopo-agent"]`).
#   docker build -t ghcr.io/gputopo/gputopo:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/gputopo
COPY pyproject.toml README.md* ./
COPY gputopo ./gputopo
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/gputopo/bin/pip install /wheels/gputopo-*.whl

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gputopo" \
      org.opencontainers.image.description="Topology-aware Kubernetes GPU scheduler extender and node agent" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/gputopo/gputopo"
ENV PATH=/opt/gputopo/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 65532 gputopo \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gputopo
COPY --from=builder /opt/gputopo /opt/gputopo
USER 65532:65532
# 8888: extender (verbs, /healthz, /readyz, /metrics); 9401: agent /metrics.
EXPOSE 8888 9401
CMD ["gputopo-extender"]
