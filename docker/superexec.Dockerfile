# App image: Flower's official flwr/superexec plus FedDifRC's dependencies. flower-superexec
# runs the ServerApp (next to the SuperLink) or a node's ClientApps (next to its SuperNode);
# the app code itself arrives with each run (the FAB), this image only provides the
# environment. Build from the repository root:
#
#   GPU nodes (ClientApp, CUDA torch):
#     docker build -f docker/superexec.Dockerfile -t feddifrc-superexec:cuda .
#   ServerApp (CPU torch):
#     docker build -f docker/superexec.Dockerfile -t feddifrc-superexec:cpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#       --build-arg REQUIRE_CUDA_TORCH=0 --build-arg REQUIRE_CPU_TORCH=1 .
#   A site that reaches neither PyTorch index (only a package registry): TORCH_INDEX_URL=<the
#   registry's simple index>, REQUIRE_CUDA_TORCH=0, REQUIRE_CPU_TORCH=0; on Linux x86_64 that
#   torch is the CUDA build, so the image is several GB larger (docs/deploy.md, offline sites).
#
# TORCH_INDEX_URL picks the torch build: .../whl/cu130 (default; driver >= 580), ... must
# match the GPU hosts' NVIDIA driver (see https://pytorch.org/get-started/locally/). TORCH_SPEC
# pins torch to the range this app is tested with, so images built on different days agree.
ARG FLWR_VERSION=1.42.0
FROM flwr/superexec:${FLWR_VERSION}
ARG FLWR_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCH_SPEC="torch>=2.9,<2.15"
ARG REQUIRE_CUDA_TORCH=1
ARG REQUIRE_CPU_TORCH=0

# HOME=/app makes the app's "~" defaults (~/.cache/feddifrc, ~/feddifrc-runs) land on the
# volumes mounted at /app/.cache and /app/feddifrc-runs; HF_HOME keeps SD weights there too.
ENV HOME=/app \
    HF_HOME=/app/.cache/huggingface \
    TORCH_HOME=/app/.cache/torch \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    PYTHONUNBUFFERED=1

USER root
RUN mkdir -p /app/.cache /app/feddifrc-runs /app/data \
 && chown app:app /app/.cache /app/feddifrc-runs /app/data
USER app
WORKDIR /app

# 1. torch + torchvision from PyTorch's index (CUDA or CPU build).
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" torchvision

# 2. The app's other dependencies (and its `feddifrc` CLI). flwr is already in the base
#    image at FLWR_VERSION, so its requirement line is dropped (as in Flower's docs); no -U,
#    so the torch build from step 1 is kept.
#    The check runs after the LAST install: it is the torch that stays in the image
#    (docker/check_image.py: flwr still the pinned one, torch the CUDA or CPU build required).
COPY --chown=app:app pyproject.toml README.md LICENSE docker/check_image.py /app/src/
COPY --chown=app:app feddifrc_app /app/src/feddifrc_app
RUN sed -i '/"flwr\[simulation\]/d' /app/src/pyproject.toml \
 && python -m pip install --no-cache-dir /app/src \
 && python /app/src/check_image.py --flwr "${FLWR_VERSION}" \
      --require-cuda "${REQUIRE_CUDA_TORCH}" --require-cpu "${REQUIRE_CPU_TORCH}"

# 3. The run configs (paper cells), for `feddifrc extract --run-config /app/conf/...` on a node.
COPY --chown=app:app conf /app/conf

ENTRYPOINT ["flower-superexec"]
