# syntax=docker/dockerfile:1.7
# The dedup gateway. Build from the repository root (the context):
#   docker build -f deploy/gateway.Dockerfile -t dedup-gateway .
# What the context may send is listed in deploy/gateway.Dockerfile.dockerignore.
#
# Configuration: a TOML file at /etc/dedup-gateway/gateway.toml (mount your own
# over the default) plus GATEWAY_* environment overrides for secrets, e.g.
# GATEWAY_REDIS__NODES='["redis://gw:pw@redis-0:6379/0", ...]'.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: the project and every dependency as wheels ----------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY gateway/ gateway/
COPY spark_sink/ spark_sink/
# Every dependency ships manylinux wheels for CPython 3.11 (hiredis, uvloop,
# pydantic-core, aiohttp...), so no compiler is needed even here.
RUN pip wheel --no-cache-dir --wheel-dir /wheels -c constraints.txt .

# --- runtime: no build tools, no pip cache, non-root -------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="dedup-gateway" \
      org.opencontainers.image.description="Crash-safe quorum dedup gateway between Kafka topics"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid gateway --home-dir /nonexistent \
        --no-create-home --shell /usr/sbin/nologin gateway

# The wheels are bind-mounted from the builder, so they never land in a layer.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/dedup_gateway-*.whl

# A default config (compose and Kubernetes mount their own over it).
COPY deploy/config/gateway.toml /etc/dedup-gateway/gateway.toml

USER 10001:10001
WORKDIR /tmp
EXPOSE 9108

# /healthz answers 200 while the process is alive. Readiness (/readyz: Redis
# majority, group joined, nothing blocked) is for orchestrators, not for this
# check: a gateway waiting out a Redis outage must not be restarted in a loop.
# The port is [metrics] port; change it here too if you change it there.
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9108/healthz', timeout=2).status == 200 else 1)"]

# Exec form: the gateway is PID 1 and gets SIGTERM itself; the first signal
# drains (finish the batch, flush, commit, leave the group), a second forces exit.
STOPSIGNAL SIGTERM
ENTRYPOINT ["dedup-gateway"]
CMD ["run", "--config", "/etc/dedup-gateway/gateway.toml"]
