# One image for both roles of docker-compose.yml: the config service (`tuner serve`) and the
# GPU tuning workers (`tuner sweep`). Build: docker compose build (or docker build -t
# attention-tuner .). The GPU hosts that measured the project's results ran torch 2.11 with
# triton 3.6; torch's CUDA wheels bring their own CUDA libraries, the base image brings the
# NVIDIA container settings and refuses to start on a driver too old for its CUDA.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# Triton compiles a small C launcher per kernel signature at run time: it needs a C compiler
# and Python's headers in the image, not only at build time.
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
        ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

# torch (with the triton it pins) first, from the CUDA wheel index: the largest layer, and the
# one that changes least often. Override both for another CUDA (e.g. cu130 on a 13.0 image).
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY templates templates
COPY tuner tuner
COPY api api
COPY db db
# psycopg for PostgreSQL; torch stays the one installed above (it satisfies the requirement).
RUN pip install ".[postgres]" \
 && python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# No secrets here: TUNER_TOKEN and the database password come from the environment at run
# time (docker-compose.yml refuses to start without them).
RUN useradd --create-home --uid 10001 tuner \
 && mkdir -p /var/tuner/gpu-locks /var/tuner/triton-cache \
 && chown -R tuner:tuner /var/tuner
# The workers share compiled kernels through this folder (a named volume in compose).
ENV TRITON_CACHE_DIR=/var/tuner/triton-cache
USER tuner

EXPOSE 8000
CMD ["tuner", "serve", "--host", "0.0.0.0", "--port", "8000"]
