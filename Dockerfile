# The agent image for monarch_kubernetes pools: Python, torch (CPU build by default) and
# monarch-torchx with its Kubernetes extra. Build it from the repository root:
#   docker build -t REGISTRY/monarch-torchx:latest .
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t REGISTRY/monarch-torchx:cu128 .
# Pools use it with -cfg image=REGISTRY/monarch-torchx:latest (or image_repo=REGISTRY).
# This Dockerfile is linted in CI (hadolint) but not built there: CI machines have no Docker engine.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the chosen index, so installing the package never pulls another build
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /opt/monarch-torchx
COPY pyproject.toml README.md ./
COPY monarch_torchx ./monarch_torchx
COPY torchx_plugins ./torchx_plugins
# the package itself, from this checkout (its dependencies are pinned by pyproject.toml's ranges)
# hadolint ignore=DL3013
RUN pip install ".[kubernetes]"

# agents run as an unprivileged user; their state dir is an emptyDir mounted by the pod
RUN useradd --create-home --uid 1000 monarch \
    && mkdir -p /var/lib/monarch-torchx /workspace \
    && chown monarch:monarch /var/lib/monarch-torchx /workspace
USER 1000
WORKDIR /workspace
EXPOSE 29600
CMD ["python", "-m", "monarch_torchx.agent", "--help"]
