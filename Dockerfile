# syntax=docker/dockerfile:1
# Two images from one file:
#   operator - the operator (slim, non-root, `phalanx run` as entrypoint)
#   trainer  - a CPU training image with torch and phalanx.worker (what the local cluster runs)
# BASE_IMAGE defaults to the usual public Python image; the local test cluster builds from a
# Debian base made on the machine, since no registry is reachable there.
# Every pip step reads PIP_INDEX_URL, PIP_FIND_LINKS and PIP_NO_INDEX when given as build args:
# a package mirror, or a local wheel cache (the test cluster serves its torch wheels that way).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS wheel
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
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

FROM ${BASE_IMAGE} AS trainer
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
ARG TORCH_VERSION=2.13.0
RUN python3 -m pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# The worker extra brings numpy (torch.distributed.checkpoint) and prometheus-client (worker metrics).
RUN python3 -m pip install --no-cache-dir "$(ls /wheels/*.whl)[worker]" && rm -rf /wheels
# `python` as well as `python3`, as every common PyTorch base image has (commands written `python ...`).
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python
# Training logs reach `kubectl logs` as they are written.
ENV PYTHONUNBUFFERED=1 LANG=C.UTF-8
WORKDIR /workspace
