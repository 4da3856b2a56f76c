# syntax=docker/dockerfile:1
# Two images from one file:
#   operator - the operator (slim, non-root, `phalanx run` as entrypoint): the `phalanx` distribution
#   trainer  - a CPU training image with torch, Transformers and the in-pod helper alone (the
#              `phalanx-worker` distribution: phalanx.worker, prometheus-client, numpy); what the
#              local cluster runs
# BASE_IMAGE defaults to the usual public Python image; the local test cluster builds from a
# Debian base made on the machine, since no registry is reachable there.
# Every pip step reads PIP_INDEX_URL, PIP_FIND_LINKS and PIP_NO_INDEX when given as build args:
# a package mirror, or a local wheel cache (the test cluster serves its torch wheels that way).
# The operator's stages come first: the classic builder (DOCKER_BUILDKIT=0) runs every stage up
# to the target, and the trainer's torch must not be a step of the operator's build.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS wheel
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
# The operator's wheel leaves phalanx.worker out (pyproject.toml); phalanx-worker ships it.
RUN python3 -m pip wheel --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE} AS operator
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
COPY --from=wheel /wheels /wheels
RUN python3 -m pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin phalanx
USER 10001
EXPOSE 8000 8080
ENTRYPOINT ["phalanx", "run"]
CMD ["--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]

# phalanx-worker (worker/pyproject.toml) from only what it is built from, so that a change to
# the operator's code leaves the trainer's layers cached.
FROM ${BASE_IMAGE} AS worker-wheel
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
WORKDIR /src
COPY worker/pyproject.toml worker/README.md ./worker/
COPY operator/phalanx/worker ./operator/phalanx/worker
RUN python3 -m pip wheel --no-deps --wheel-dir /wheels ./worker

FROM ${BASE_IMAGE} AS trainer
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG TORCH_VERSION=2.13.0
RUN python3 -m pip install --no-cache-dir "torch==${TORCH_VERSION}"
# Hugging Face Transformers (and accelerate, which its Trainer needs), for jobs that train with its
# Trainer and phalanx.worker.progress's callback; a step of its own so torch's layer stays cached.
# The local cluster's build passes the frameworks extra's pins (tests/cluster/node/images.py).
ARG TRANSFORMERS_REQUIREMENTS="transformers==5.25.0 accelerate==1.16.0"
RUN python3 -m pip install --no-cache-dir ${TRANSFORMERS_REQUIREMENTS}
COPY --from=worker-wheel /wheels /wheels
# phalanx-worker brings prometheus-client (worker metrics) and numpy (torch.distributed.checkpoint);
# nothing of the operator (kopf, pydantic, aiohttp, kubernetes). The rendezvous store pod runs
# this image too: it needs torch alone.
RUN python3 -m pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# `python` as well as `python3`, as every common PyTorch base image has (commands written `python ...`).
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
# Training logs reach `kubectl logs` as they are written.
ENV PYTHONUNBUFFERED=1 LANG=C.UTF-8
WORKDIR /workspace
