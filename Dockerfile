# The PersonaPlex server on a CUDA base: `docker build -t personaplex-server .`, then
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -e HF_TOKEN personaplex-server
# (docs/deploy.md: the ports, the drain on `docker stop -t`, WebRTC's UDP).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --no-cache-dir -q "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/personaplex
COPY pyproject.toml README.md ./
COPY app app
COPY media media
COPY model model
COPY static static
RUN pip install --no-cache-dir -q -e . \
 && useradd --create-home --uid 10001 personaplex
USER personaplex

# Every flag has a PERSONAPLEX_* twin; these are the container's defaults (docs/deploy.md).
ENV PERSONAPLEX_HOST=0.0.0.0 \
    PERSONAPLEX_PORT=8000 \
    PERSONAPLEX_AGENT_PORT=8001 \
    PERSONAPLEX_DRAIN_TIMEOUT_S=300 \
    PERSONAPLEX_KV_CACHE=fp8
EXPOSE 8000/tcp 8001/tcp
# Liveness only: a full or draining server is alive (readiness is /health/ready, for the balancer).
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
  CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/live' % os.environ['PERSONAPLEX_PORT'], timeout=3)"
# SIGTERM drains (no new sessions; live ones run up to PERSONAPLEX_DRAIN_TIMEOUT_S), so stop with
# `docker stop -t 320`: the drain, the final close and a margin.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python3", "-m", "app"]
