#!/usr/bin/env bash
# Build the virtual environment the vLLM integration tests run in: vLLM 0.34.0 in .venv-vllm by
# default. Another supported release in a venv of its own, named after it:
#   KVATLAS_VLLM_VERSION=0.33.0 bash tests/vllm_plugin/setup_env.sh      # builds .venv-vllm-0.33.0
#   .venv-vllm-0.33.0/bin/python -m pytest -q tests/vllm_plugin
# (KVATLAS_VLLM_VENV names the venv explicitly.)
#
# vLLM's wheel (0.33.0 and 0.34.0 alike) pins a CUDA torch 2.14.0 and a long list of serving dependencies, and its
# compiled extension (vllm._C) does not load on a CPU; nothing on the KV planning and scheduling
# path needs it. So: the local CPU torch, the wheel itself with --no-deps, and only what vLLM's
# import chain down to the engine core's planner, the scheduler and the metrics needs. Wheels
# (~330 MB of vLLM, ~500 MB besides, triton the largest) come from a wheelhouse outside the
# checkout (tests/engine_venv.sh). Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/engine_venv.sh
ENGINE=vllm
DEFAULT_VERSION="0.34.0"
VERSION="${KVATLAS_VLLM_VERSION:-$DEFAULT_VERSION}"
case "$VERSION" in
  0.33.*|0.34.*) ;;
  *) echo "setup_env: KVATLAS_VLLM_VERSION=$VERSION: kvatlas knows vLLM 0.33.x and 0.34.x; give one of those" >&2; exit 2;;
esac
if [ "$VERSION" = "$DEFAULT_VERSION" ]; then VENV="${KVATLAS_VLLM_VENV:-.venv-vllm}"
else VENV="${KVATLAS_VLLM_VENV:-.venv-vllm-$VERSION}"; fi
PY="$(command -v python3.11 || command -v python3)"
# vLLM without its pins; then what `import vllm.v1.engine.core` and the scheduler need, then
# kvatlas's own needs (its tests included); xgrammar asks for torch (held at 2.13.0)
NODEPS=("vllm==$VERSION")
DEPS=(numpy pydantic "transformers>=5.16.1,<5.21.0" psutil msgspec cachetools regex pyyaml cloudpickle blake3
      py-cpuinfo pyzmq einops tqdm requests cbor2 aiohttp openai-harmony openai pybase64 uvloop xgrammar fastapi
      partial-json-parser llguidance pillow prometheus_client)
OWN=("setuptools>=68" "rich>=13" "matplotlib>=3.7" "pytest>=7" "hypothesis>=6.80" "jsonschema>=4.18")
OWN+=("msgpack>=1.0")   # kvatlas[routing] (pyzmq is in vLLM's own list): the routing tests against the engine
engine_venv_begin || exit 0
engine_venv_done "import vllm.v1.core.sched.scheduler, vllm.plugins, kvatlas.integrations.vllm"
