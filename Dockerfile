# syntax=docker/dockerfile:1
# powerbatch: the power-aware admission proxy, and its embedded simulator (`powerbatch sim`).
#
#   docker build -t powerbatch:local .
#   docker run --rm -p 8000:8000 -e POWERBATCH_UPSTREAM=http://vllm:8000 \
#       -e POWERBATCH_CEILING_W=490 powerbatch:local serve
#
# Stack: docker-compose.yml (profiles `sim` and `gpu`); operator guide: docs/operations.md.
ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with powerbatch and its dependencies, no compilers kept ----
FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# .dockerignore lets through only pyproject.toml, README.md, LICENSE and the powerbatch package.
COPY . .
# `touch -a` only creates README.md when the build context lacks it (pyproject names it as readme).
RUN touch -a README.md \
    && python -m venv /opt/powerbatch \
    && /opt/powerbatch/bin/pip install --upgrade pip \
    && /opt/powerbatch/bin/pip install . \
    && /opt/powerbatch/bin/python -m compileall -q /opt/powerbatch/lib

# ---- runtime: the venv on a slim base, as an unprivileged user ----
FROM python:${PYTHON_VERSION}-slim
ARG UID=10001
RUN useradd --system --uid "${UID}" --user-group --no-create-home --home-dir /var/lib/powerbatch \
        --shell /usr/sbin/nologin powerbatch \
    && install -d -o "${UID}" -g "${UID}" /var/lib/powerbatch
COPY --from=build /opt/powerbatch /opt/powerbatch
# NVIDIA_DRIVER_CAPABILITIES=utility: the NVIDIA Container Toolkit mounts libnvidia-ml (NVML) and
# nothing more; powerbatch reads power and never runs CUDA. PROMETHEUS_DISABLE_CREATED_SERIES
# drops prometheus_client's `_created` series. A container listens on all interfaces.
ENV PATH=/opt/powerbatch/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=True \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    POWERBATCH_HOST=0.0.0.0 \
    POWERBATCH_HEALTH_URL=http://127.0.0.1:8000/health
WORKDIR /var/lib/powerbatch
# Numeric, so Kubernetes' runAsNonRoot can check it. The hardware backstop (NVML power limit)
# needs uid 0 plus CAP_SYS_ADMIN: see docs/operations.md, "Permissions".
USER ${UID}:${UID}
EXPOSE 8000
# Liveness only (/health). Readiness, which also needs the upstream, is GET /ready.
# The simulator service points POWERBATCH_HEALTH_URL at its own port.
HEALTHCHECK --interval=10s --timeout=4s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('POWERBATCH_HEALTH_URL', 'http://127.0.0.1:8000/health'), timeout=3)"]
ENTRYPOINT ["python", "-m", "powerbatch"]
CMD ["serve"]
