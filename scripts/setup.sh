#!/usr/bin/env bash
# setup.sh: install what sublinear needs and build it into build/ (idempotent).
#   1. Debian packages (apt-get, only when some are missing),
#   2. LibTorch from the PyPI torch wheel (and matplotlib, for scripts/plot.py; safetensors,
#      transformers, tokenizers, tensorboard and peft: the references the tests check against; tokenizers also
#      tokenizes text in scripts/prepare_data.py) in a venv at
#      ${SUBLINEAR_HOME:-~/.cache/sublinear}/venv,
#   3. CMake configure (Ninja, Release; -DSUBLINEAR_WERROR=ON when CI=true) and build.
# Cost: first run downloads the CUDA torch wheel with its nvidia-* deps (~4.6 GB, ~35 s through uv on
# the link docs/setup.md names) and compiles the project (minutes on 2 cores); a re-run only rebuilds
# what changed.
set -euo pipefail

TORCH_VERSION=2.11.0   # the one place the LibTorch version is pinned
MATPLOTLIB_VERSION=3.11.2  # scripts/plot.py draws the sweep figures with it
SAFETENSORS_VERSION=0.8.0  # the reference implementation tests/test_safetensors.cpp checks files against
TRANSFORMERS_VERSION=5.23.0  # the reference GPT-2 / LLaMA tests/test_hf.cpp checks the model and its export against
TOKENIZERS_VERSION=0.23.3    # Hugging Face tokenizers: scripts/prepare_data.py tokenizes with it; tests check ours against it
TENSORBOARD_VERSION=2.21.0   # the reader tests/test_tensorboard checks logging.tensorboard's event files with
PEFT_VERSION=0.22.0          # the LoRA adapter loader tests/test_hf checks trainer export's adapter directories with
UV_VERSION=0.13.10           # the installer of the above (parallel downloads)
PACKAGES=(cmake ninja-build g++ ccache libgloo-dev libyaml-cpp-dev libcli11-dev libspdlog-dev libfmt-dev
          nlohmann-json3-dev catch2 python3-venv zlib1g-dev libicu-dev libprotobuf-dev protobuf-compiler)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUBLINEAR_HOME="${SUBLINEAR_HOME:-$HOME/.cache/sublinear}"
VENV="$SUBLINEAR_HOME/venv"
say() { echo "setup: $*"; }
# Each phase's seconds, printed at the end (the figure docs/setup.md quotes comes from this line of CI's log).
phase_start=$SECONDS
declare -a PHASES=()
phase_done() { PHASES+=("$1 $((SECONDS - phase_start)) s"); phase_start=$SECONDS; }

# 1. Debian packages.
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    SUDO=(sudo)
  fi
  say "apt-get install ${missing[*]}"
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  say "Debian packages present"
fi

phase_done "packages"

# 2. torch wheel and the test references in the venv (outside the repo). What is missing is installed
# in one call of uv (PyPI's `uv`, pinned): it fetches the wheels in parallel, which takes the ~4.6 GB
# of torch and its nvidia-* libraries from 199-261 s with pip down to ~35 s on the same link
# (docs/setup.md).
PY="$VENV/bin/python"
[[ -x "$PY" ]] || { say "creating venv $VENV"; python3 -m venv "$VENV"; }
# One interpreter start: prints the CMake prefix path when the pinned torch imports.
torch_prefix() {
  "$PY" -W ignore -c "import sys, torch, torch.utils
sys.exit(1) if not torch.__version__.startswith('$TORCH_VERSION') else print(torch.utils.cmake_prefix_path)" 2>/dev/null
}
want=()
if PREFIX="$(torch_prefix)"; then
  say "torch $TORCH_VERSION present in $VENV"
else
  want+=("torch==$TORCH_VERSION")
fi
# pin MODULE PACKAGE VERSION: wants PACKAGE==VERSION unless MODULE already imports at VERSION.
pin() {
  if "$PY" -c "import $1, sys; sys.exit($1.__version__ != '$3')" 2>/dev/null; then
    say "$2 $3 present"
  else
    want+=("$2==$3")
  fi
}
pin matplotlib matplotlib "$MATPLOTLIB_VERSION"
pin safetensors safetensors "$SAFETENSORS_VERSION"
pin transformers transformers "$TRANSFORMERS_VERSION"
pin tokenizers tokenizers "$TOKENIZERS_VERSION"
pin tensorboard tensorboard "$TENSORBOARD_VERSION"
pin peft peft "$PEFT_VERSION"
if ((${#want[@]})); then
  [[ -x "$VENV/bin/uv" ]] || "$PY" -m pip install --quiet "uv==$UV_VERSION"
  say "uv pip install ${want[*]}"
  "$VENV/bin/uv" pip install --quiet --python "$PY" "${want[@]}"
  PREFIX="$(torch_prefix)" || { echo "setup: torch $TORCH_VERSION does not import from $VENV" >&2; exit 1; }
fi

phase_done "Python packages"

# The wheel's CMake config looks for a CUDA toolkit and an architecture list.
[[ -x /usr/local/cuda/bin/nvcc ]] && [[ ":$PATH:" != *":/usr/local/cuda/bin:"* ]] && export PATH="/usr/local/cuda/bin:$PATH"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"

# 3. Configure (fast when cached) and build.
CMAKE_ARGS=(-S "$ROOT" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PREFIX")
[[ "${CI:-}" == true ]] && CMAKE_ARGS+=(-DSUBLINEAR_WERROR=ON)
say "cmake configure -> build/"
cmake "${CMAKE_ARGS[@]}" >/dev/null
say "cmake --build build -j 2"
cmake --build "$ROOT/build" -j 2
phase_done "configure and build"
say "done: $ROOT/build/trainer (${PHASES[*]/%/;} total $SECONDS s)"
