#!/usr/bin/env bash
# Build the virtual environment the vLLM integration tests run in (.venv-vllm by default).
#
# vLLM 0.33.0's wheel pins a CUDA torch 2.14.0 and a long list of serving dependencies, and its
# compiled extension (vllm._C) does not load on a CPU; nothing on the KV planning and scheduling
# path needs it. So: the local CPU torch, the wheel itself with --no-deps, and only what vLLM's
# import chain down to the engine core's planner, the scheduler and the metrics needs. Wheels
# (~330 MB of vLLM, ~500 MB besides, triton the largest) come from a wheelhouse outside the
# checkout (tests/engine_venv.sh). Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/engine_venv.sh
ENGINE=vllm
VERSION="0.33.0"
VENV="${KVATLAS_VLLM_VENV:-.venv-vllm}"
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
