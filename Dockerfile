# syntax=docker/dockerfile:1
# One image for every Flywheel service; the command picks the service:
#   docker run IMAGE buffer -c /etc/flywheel/run.toml
#   docker run --entrypoint torchrun IMAGE ... -m services.trainer -c run.toml
#
#   docker build -t flywheel:cpu .                              # CPU torch wheel
#   docker build -t flywheel:cuda --build-arg VARIANT=cuda .    # CUDA torch wheel
#
# Why one base image for both variants: PyTorch's CUDA wheels carry the CUDA
# runtime libraries (the nvidia-* wheels), so the GPU variant needs only the
# host driver, which the NVIDIA container runtime mounts. The variant changes
# the torch wheel index and nothing else. On Kubernetes GPU nodes the engine
# is the official SGLang image; this image's CUDA variant runs the trainer.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/flywheel \
    PATH=/opt/flywheel/bin:$PATH
RUN python -m venv /opt/flywheel

# Same pin as the Makefile: an unpinned torch pulls whatever the index has.
FROM base AS torch-cpu
ARG TORCH=torch==2.13.0
RUN pip install "${TORCH}" --index-url https://download.pytorch.org/whl/cpu

FROM base AS torch-cuda
ARG TORCH=torch==2.13.0
ARG CUDA_INDEX=cu128
RUN pip install "${TORCH}" --index-url "https://download.pytorch.org/whl/${CUDA_INDEX}"

FROM torch-${VARIANT} AS final
# bubblewrap: the sandbox of rewards and tools (`flywheel sandbox`, the sidecar).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
# A plain (non-editable) install: the sources are not needed at run time.
RUN pip install ".[math,reasoning,lora,tinker]" && rm -rf /src
# A fixed numeric uid so Kubernetes' runAsNonRoot can verify it without /etc/passwd.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp flywheel \
    && mkdir -p /data /etc/flywheel \
    && chown flywheel:flywheel /data
# Caches go to /tmp: the pods run with a read-only root filesystem and an
# emptyDir on /tmp. Nothing is downloaded at run time (HF_HUB_OFFLINE). No progress
# bars: a pod started by torchrun or sglang, not `flywheel`, would draw a log line per
# redraw on every weight load (services/models/progress.py).
ENV HOME=/tmp \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1
USER 10001:10001
WORKDIR /tmp
EXPOSE 9100 30000
ENTRYPOINT ["flywheel"]
CMD ["--help"]
