#!/usr/bin/env bash
# Build the virtual environment the SGLang integration tests run in (.venv-sglang by default).
#
# SGLang 0.5.23 ships a cp311 wheel that pins a CUDA torch and ~2.5 GB of serving dependencies; the
# main test environment stays small, so the integration tests get a venv of their own. Only what
# SGLang's import chain down to the KV-pool code needs is installed, against the local CPU torch.
#
# The wheels (~1.5 GB, triton the largest) are downloaded once into a wheelhouse outside the
# checkout (KVATLAS_WHEELHOUSE, default ~/.cache/kvatlas/sglang-0.5.23-wheels): pip keeps no cache
# on these machines, and the download dominates a cold build. Whatever the wheelhouse lacks is
# installed from the registry as usual, so a missing or partial wheelhouse only costs time.
# Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVATLAS_SGLANG_VENV:-.venv-sglang}"
STAMP="$VENV/.kvatlas-sglang-ready"
SGLANG_VERSION="0.5.23"
WH="${KVATLAS_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvatlas/sglang-$SGLANG_VERSION-wheels}"
if [ -f "$STAMP" ]; then echo "sglang venv ready: $VENV"; exit 0; fi

PY="$(command -v python3.11 || true)"
if [ -z "$PY" ]; then echo "setup_env: SGLang $SGLANG_VERSION ships a cp311 wheel only; python3.11 not found" >&2; exit 1; fi
start=$(date +%s)
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# SGLang without its pins (they name torch 2.14.1 and the GPU kernels) and what `import
# sglang.srt...` needs down to the memory pools and the plugin loader; then kvatlas's own needs
NODEPS=("sglang==$SGLANG_VERSION" "compressed-tensors==0.18.0")
DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm
      ipython aiohttp "apache-tvm-ffi==0.1.11" "transformers==5.19.0" dill sentencepiece loguru gguf
      openai partial-json-parser)   # the last two: the radix cache's import chain (the plugin's evictable tests)
OWN=("setuptools>=68" "rich>=13" "matplotlib>=3.7" "prometheus_client>=0.19" "pytest>=7" "hypothesis>=6.80")
# the stamp names what the wheelhouse was filled for: a changed list fills in what is missing
WANT="$(echo "${NODEPS[@]}" "${DEPS[@]}" "${OWN[@]}")"
if [ "$(cat "$WH/.complete" 2>/dev/null)" != "$WANT" ]; then
  mkdir -p "$WH"
  if $PIP download -q -d "$WH" --no-deps "${NODEPS[@]}" && $PIP download -q -d "$WH" "${DEPS[@]}" "${OWN[@]}"; then
    echo "$WANT" > "$WH/.complete"
  else
    echo "setup_env: wheelhouse incomplete; installing from the registry" >&2
  fi
fi
install() {   # from the wheelhouse; whatever it lacks, from the registry
  $PIP install -q --no-index --find-links "$WH" "$@" 2>/dev/null || $PIP install -q "$@"
}
# torch first, from the local CPU build, so nothing below pulls a CUDA build
$PIP install -q torch==2.13.0
install --no-deps "${NODEPS[@]}"
install "${DEPS[@]}" "${OWN[@]}"
# kvatlas with its [sglang] extra, editable: the entry point then names this checkout
$PIP install -q --no-build-isolation --no-deps -e .
# a stand-in for torchvision: SGLang imports torchvision.transforms at module level for multimodal
# preprocessing, PyPI's builds need a CUDA torch, and nothing on the KV-pool path calls it
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$(pwd)/tests/sglang_plugin/standin" > "$SITE/kvatlas-torchvision-standin.pth"
"$VENV/bin/python" -W ignore -c "import sglang.srt.plugins, sglang.srt.mem_cache.memory_pool, kvatlas.integrations.sglang"
touch "$STAMP"
echo "sglang venv built in $(( $(date +%s) - start )) s: $VENV"
