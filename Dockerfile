# Dockerfile: builds sublinear (LibTorch from the PyPI torch wheel) on the CUDA 13.0 devel image
# and, by default, trains configs/tiny.yaml (CPU recipe; GPU recipes need `docker run --gpus all`).
# Cost: ~4.6 GB torch wheel download plus the C++ build; the image is well over 10 GB.
# NOTE: not built with Docker (the development machines have no Docker engine). Every package below
# was looked up in Ubuntu 24.04's archive instead, and the project was compiled against noble's
# headers and CMake configs (Catch2 3.4 also linked and tested): see docs/distributions.md.
#   docker build -t sublinear . && docker run --rm sublinear
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04

# Keep both in step with scripts/setup.sh's pins (setup.sh then finds them and installs nothing).
ARG TORCH_VERSION=2.11.0
ARG MATPLOTLIB_VERSION=3.11.2
ARG SAFETENSORS_VERSION=0.8.0
ARG TRANSFORMERS_VERSION=5.23.0
ARG TOKENIZERS_VERSION=0.23.3
ARG TENSORBOARD_VERSION=2.21.0
ARG UV_VERSION=0.13.10
ENV DEBIAN_FRONTEND=noninteractive \
    SUBLINEAR_HOME=/opt/sublinear \
    TORCH_CUDA_ARCH_LIST=9.0 \
    PATH=/usr/local/cuda/bin:$PATH

# The same packages scripts/setup.sh checks for (it skips apt when they are present), plus python3.
# On Ubuntu 24.04 `catch2` is Catch2 3.4 and libyaml-cpp-dev is 0.8; both are handled by CMakeLists.txt
# and tests/catch.h.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake ninja-build g++ ccache libgloo-dev libyaml-cpp-dev \
      libcli11-dev libspdlog-dev libfmt-dev nlohmann-json3-dev catch2 python3 python3-venv zlib1g-dev \
      libicu-dev libprotobuf-dev protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*

# Its own layer, so code changes do not re-download torch or matplotlib. A venv, so Ubuntu 24.04's
# PEP 668 marker (externally managed system Python) does not apply.
RUN python3 -m venv "$SUBLINEAR_HOME/venv" \
 && "$SUBLINEAR_HOME/venv/bin/python" -m pip install --quiet --no-cache-dir "uv==$UV_VERSION" \
 && "$SUBLINEAR_HOME/venv/bin/uv" pip install --quiet --no-cache --python "$SUBLINEAR_HOME/venv/bin/python" \
      "torch==$TORCH_VERSION" "matplotlib==$MATPLOTLIB_VERSION" "safetensors==$SAFETENSORS_VERSION" \
      "transformers==$TRANSFORMERS_VERSION" "tokenizers==$TOKENIZERS_VERSION" "tensorboard==$TENSORBOARD_VERSION"

WORKDIR /src/sublinear
COPY . .
RUN scripts/setup.sh

CMD ["build/trainer", "--config", "configs/tiny.yaml"]
