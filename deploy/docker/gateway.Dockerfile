# The atomesh gateway: slim, non-root, no torch (the engine is a separate image).
# Build from the repository root:  docker build -f deploy/docker/gateway.Dockerfile -t atomesh-gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# Only what the gateway's distribution needs: its metadata and the atomesh package (no engine/).
COPY pyproject.toml README.md ./
COPY atomesh ./atomesh
RUN python -m venv /opt/atomesh \
 && /opt/atomesh/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/atomesh/bin/pip install --no-cache-dir ".[kubernetes]" \
 && ! /opt/atomesh/bin/python -c "import torch" 2>/dev/null
# The native stream relay (splice.c), OTLP encoder (otlp_encode.c) and trace recorder (trace_record.c), built here
# with a compiler the final image does not carry, into the cache the final image reads (they are named by source,
# flags and Python, not compiler).
ENV XDG_CACHE_HOME=/opt/atomesh/cache
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && /opt/atomesh/bin/python -c "from atomesh import otlp_native, splice, tracing; \
b, e, (r, why) = splice.build(), otlp_native.build_encoder(), tracing.native_recorder(); \
assert b.module is not None, b.why_not; assert e.library is not None, e.why_not; assert r is not None, why"

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin atomesh
COPY --from=build /opt/atomesh /opt/atomesh
ENV PATH=/opt/atomesh/bin:$PATH \
    XDG_CACHE_HOME=/opt/atomesh/cache \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ATOMESH_HEALTH_URL=http://127.0.0.1:30000/liveness
USER 10001:10001
EXPOSE 30000 29000
# Liveness of the process (Kubernetes uses its own probes; this serves `docker run`).
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['ATOMESH_HEALTH_URL'], timeout=2)"]
ENTRYPOINT ["atomesh", "launch"]
CMD ["--host", "0.0.0.0", "--port", "30000", "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"]
