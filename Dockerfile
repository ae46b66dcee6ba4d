# lorapool's two images, from one build of the package:
#
#   docker build --target gateway -t lorapool:0.1.0 .          # no torch: serve, audit-writer,
#                                                               # audit roles, exporter, rq, operator
#   docker build --target worker  -t lorapool-worker:0.1.0 .   # + the CUDA build of torch
#
# Both run as the user lorapool (uid 10001, group 0), never root: Kubernetes'
# runAsNonRoot can check the numeric uid. .dockerignore keeps the context to the
# package's sources (no .venv, no *.key, no tests, no caches).
# tests/unit/test_dockerfile.py checks the pins against pyproject.toml and the Makefile.

# Python 3.12 (pyproject: requires-python >= 3.10), Debian 12
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/lorapool \
    PATH=/opt/lorapool/bin:$PATH
RUN useradd --uid 10001 --gid 0 --create-home --home-dir /home/lorapool lorapool \
    && python -m venv /opt/lorapool

# --- the package, built once into a wheel ----------------------------------------
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lorapool lorapool
COPY engine engine
COPY kernels kernels
COPY worker worker
COPY producer producer
COPY audit_db audit_db
COPY gateway gateway
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- gateway: lorapool serve and every torch-free role -----------------------------
FROM base AS gateway
COPY --from=wheel /wheels /wheels
RUN pip install "lorapool[gateway,audit] @ file://$(ls /wheels/lorapool-*.whl)" \
    && rm -rf /wheels \
    && ! python -c "import torch" 2>/dev/null
USER 10001:0
WORKDIR /home/lorapool
EXPOSE 8000
CMD ["lorapool", "serve", "--host", "0.0.0.0", "--port", "8000"]

# --- worker: one engine per GPU ---------------------------------------------------
FROM base AS worker
# Triton compiles its launcher with the system's C compiler when a kernel first runs
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# PyPI's torch for Linux x86_64 is the CUDA build (its CUDA libraries come as wheels);
# the same version as the Makefile's CPU build, so CI tests what the image runs
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install "lorapool[worker] @ file://$(ls /wheels/lorapool-*.whl)" "torch==${TORCH_VERSION}" \
    && rm -rf /wheels
# Triton's and the kernels' caches: writable under a read-only root (the chart mounts /tmp)
ENV TRITON_CACHE_DIR=/tmp/triton HOME=/home/lorapool
USER 10001:0
WORKDIR /home/lorapool
EXPOSE 9300
CMD ["lorapool", "worker", "--help"]
