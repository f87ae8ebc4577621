#!/usr/bin/env bash
# Build the virtual environment the SGLang integration tests run in (.venv-sglang by default).
#
# SGLang 0.5.23 ships a cp311 wheel that pins a CUDA torch and ~2.5 GB of serving dependencies; the
# main test environment stays small, so the integration tests get a venv of their own. Only what
# SGLang's import chain down to the KV-pool code and its radix cache needs is installed, against
# the local CPU torch. Wheels (~1.5 GB, triton the largest) come from a wheelhouse outside the
# checkout (tests/engine_venv.sh). Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/engine_venv.sh
ENGINE=sglang
VERSION="0.5.23"
VENV="${KVATLAS_SGLANG_VENV:-.venv-sglang}"
PY="$(command -v python3.11 || true)"
if [ -z "$PY" ]; then echo "setup_env: SGLang $VERSION ships a cp311 wheel only; python3.11 not found" >&2; exit 1; fi
# SGLang without its pins (they name torch 2.14.1 and the GPU kernels) and what `import
# sglang.srt...` needs down to the memory pools, the radix cache and the plugin loader; then
# kvatlas's own needs
NODEPS=("sglang==$VERSION" "compressed-tensors==0.18.0")
DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm
      ipython aiohttp "apache-tvm-ffi==0.1.11" "transformers==5.19.0" dill sentencepiece loguru gguf
      openai partial-json-parser)   # the last two: the radix cache's import chain
OWN=("setuptools>=68" "rich>=13" "matplotlib>=3.7" "prometheus_client>=0.19" "pytest>=7" "hypothesis>=6.80"
     "jsonschema>=4.18")
engine_venv_begin || exit 0
# a stand-in for torchvision: SGLang imports torchvision.transforms at module level for multimodal
# preprocessing, PyPI's builds need a CUDA torch, and nothing on the KV-pool path calls it
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$(pwd)/tests/sglang_plugin/standin" > "$SITE/kvatlas-torchvision-standin.pth"
engine_venv_done "import sglang.srt.plugins, sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.unified_radix_cache, kvatlas.integrations.sglang"
