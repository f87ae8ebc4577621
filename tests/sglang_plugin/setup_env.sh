#!/usr/bin/env bash
# Build the virtual environment the SGLang integration tests run in (.venv-sglang by default).
#
# SGLang 0.5.23 ships a cp311 wheel that pins a CUDA torch and ~2.5 GB of serving dependencies; the
# main test environment stays small, so the integration tests get a venv of their own. Only what
# SGLang's import chain down to the KV-pool code needs is installed, against the local CPU torch.
# Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVATLAS_SGLANG_VENV:-.venv-sglang}"
STAMP="$VENV/.kvatlas-sglang-ready"
SGLANG_VERSION="0.5.23"
if [ -f "$STAMP" ]; then echo "sglang venv ready: $VENV"; exit 0; fi

PY="$(command -v python3.11 || true)"
if [ -z "$PY" ]; then echo "setup_env: SGLang $SGLANG_VERSION ships a cp311 wheel only; python3.11 not found" >&2; exit 1; fi
start=$(date +%s)
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# torch first, so nothing below pulls a CUDA build
$PIP install -q torch==2.13.0
# SGLang itself without its pins (they name torch 2.14.1 and the GPU kernels)
$PIP install -q --no-deps "sglang==$SGLANG_VERSION"
$PIP install -q --no-deps "compressed-tensors==0.18.0"
# what `import sglang.srt...` needs down to the memory pools and the plugin loader
$PIP install -q numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
  pydantic pyzmq tqdm ipython aiohttp "apache-tvm-ffi==0.1.11" "transformers==5.19.0" dill \
  sentencepiece loguru gguf
# kvatlas with its [sglang] extra (editable: the entry point then names this checkout) and test tools
$PIP install -q -e '.[sglang,test]'
# a stand-in for torchvision: SGLang imports torchvision.transforms at module level for multimodal
# preprocessing, PyPI's builds need a CUDA torch, and nothing on the KV-pool path calls it
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$(pwd)/tests/sglang_plugin/standin" > "$SITE/kvatlas-torchvision-standin.pth"
"$VENV/bin/python" -c "import sglang.srt.plugins, sglang.srt.mem_cache.memory_pool; print('sglang import ok')"
touch "$STAMP"
echo "sglang venv built in $(( $(date +%s) - start )) s: $VENV"
