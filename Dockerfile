# syntax=docker/dockerfile:1
# onegpu on NVIDIA's NGC PyTorch image: torch, CUDA, cuDNN, NCCL and Triton built and tuned by NVIDIA
# for their GPUs, so the fast paths (fused optimizers, SDPA flash kernels, torch.compile) work out
# of the box. Bump NGC_TAG to a newer monthly release (YY.MM-py3) as they come out.
#
#   docker build -t onegpu .
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/work/runs onegpu doctor
#   docker run --gpus all --ipc=host --rm -v $PWD/runs:/work/runs onegpu train
ARG NGC_TAG=25.05-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HOME=/cache/huggingface \
    ONEGPU_CACHE=/cache/onegpu

WORKDIR /opt/onegpu
COPY pyproject.toml README.md ./
COPY src ./src

# Pin the image's own torch (and the kernels built against it): without the constraint, resolving
# the extras could pull a generic PyPI torch over NVIDIA's build.
RUN python - <<'PY' > /tmp/keep.txt
import importlib.metadata as md
for dist in ("torch", "triton", "flash_attn", "flash-attn", "transformer_engine"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
PY
RUN PIP_CONSTRAINT=/tmp/keep.txt pip install ".[all]" \
 && onegpu --version \
 && python -c "import torch, onegpu.cli.doctor; print('torch', torch.__version__)"

WORKDIR /work
VOLUME ["/cache", "/work/runs"]
ENTRYPOINT ["onegpu"]
CMD ["doctor"]
