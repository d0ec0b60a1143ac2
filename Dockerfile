# syntax=docker/dockerfile:1
#
# The dtwatch watchdog image: `dtwatch watch`, the per-node sidecar of the Helm chart (helm/dtwatch).
#
#   docker build -t ghcr.io/dtwatch/dtwatch:0.1.0 .
#   docker run --rm -p 9464:9464 ghcr.io/dtwatch/dtwatch:0.1.0 watch --dir /tmp/dtwatch
#
# Not built by this repository's CI: its machines have no container engine (no Docker daemon), so the
# chart is tested by rendering it (tests/test_helm.py), and the sidecar's PID-namespace and ptrace
# mechanics by simulating the pod with unshare.
#
# Also a usable trainer base for CPU smoke tests (the chart's trainer defaults to this image): it has
# torch (CPU), dtwatch and torchrun. GPU training needs your own image with dtwatch installed.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# torch first, pinned and from PyTorch's CPU index: dtwatch requires torch>=2.4, and resolving that
# from PyPI would install the newest CUDA build (several GB). The watchdog reads the ranks' rings and
# torch's flight-recorder dumps; it never runs a kernel, so the CPU wheel is enough. Keep TORCH_VERSION
# at the torch version CI tests against.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# dtwatch itself, with its dependencies from PyPI (numpy, prometheus-client, py-spy; torch is already
# satisfied). py-spy lands in /usr/local/bin, on PATH, where the watchdog looks for it.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dtwatch ./dtwatch
RUN pip install --no-cache-dir . \
    && cd / && rm -rf /src \
    && dtwatch --version && py-spy --version

# Non-root, with a numeric UID so Kubernetes' runAsNonRoot can verify it. 1000 is the chart's default
# for both the trainer and the watchdog: a non-root watchdog can only read the stacks of processes of
# its own UID. HOME is /tmp because the chart mounts the root filesystem read-only and /tmp writable.
RUN groupadd --gid 1000 dtwatch \
    && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin dtwatch
ENV HOME=/tmp
USER 1000:1000
WORKDIR /tmp

# /metrics (Prometheus), /healthz and /readyz. No HEALTHCHECK: Kubernetes probes those endpoints.
EXPOSE 9464
ENTRYPOINT ["dtwatch"]
CMD ["watch"]
