#!/usr/bin/env bash
# Build the virtual environment the vLLM integration tests run in (.venv-vllm by default).
#
# vLLM 0.33.0's wheel pins a CUDA torch 2.14.0 and a long list of serving dependencies, and its
# compiled extension (vllm._C) does not load on a CPU; nothing on the KV planning and scheduling
# path needs it. So: the local CPU torch, the wheel itself with --no-deps, and only what vLLM's
# import chain down to the engine core's planner, the scheduler and the metrics needs.
#
# The wheels (~330 MB of vLLM, ~500 MB besides, triton the largest) are downloaded once into a wheelhouse outside the
# checkout (KVATLAS_WHEELHOUSE, default ~/.cache/kvatlas/vllm-0.33.0-wheels): pip keeps no cache
# on these machines, and the download dominates a cold build. Whatever the wheelhouse lacks is
# installed from the registry as usual, so a missing or partial wheelhouse only costs time.
# Idempotent: a finished venv (stamp file present) is left as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVATLAS_VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.kvatlas-vllm-ready"
VLLM_VERSION="0.33.0"
WH="${KVATLAS_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvatlas/vllm-$VLLM_VERSION-wheels}"
if [ -f "$STAMP" ]; then echo "vllm venv ready: $VENV"; exit 0; fi

PY="$(command -v python3.11 || command -v python3)"
start=$(date +%s)
"$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# vLLM without its pins; then what `import vllm.v1.engine.core` and the scheduler need, then
# kvatlas's own needs (its tests included)
NODEPS=("vllm==$VLLM_VERSION")
DEPS=(numpy pydantic "transformers>=5.16.1,<5.21.0" psutil msgspec cachetools regex pyyaml cloudpickle blake3
      py-cpuinfo pyzmq einops tqdm requests cbor2 aiohttp openai-harmony openai pybase64 uvloop xgrammar fastapi
      partial-json-parser llguidance pillow prometheus_client)
OWN=("setuptools>=68" "rich>=13" "matplotlib>=3.7" "pytest>=7" "hypothesis>=6.80")
# xgrammar asks for torch: resolving against the local CPU build keeps a CUDA build (and its ~3 GB of
# nvidia wheels) out of the wheelhouse; the copy of the local torch wheel is then dropped from it
PIN="$VENV/kvatlas-constraints.txt"
echo "torch==2.13.0" > "$PIN"
# the stamp names what the wheelhouse was filled for: a changed list fills in what is missing
WANT="$(echo "${NODEPS[@]}" "${DEPS[@]}" "${OWN[@]}")"
if [ "$(cat "$WH/.complete" 2>/dev/null)" != "$WANT" ]; then
  mkdir -p "$WH"
  if $PIP download -q -d "$WH" --no-deps "${NODEPS[@]}" && $PIP download -q -d "$WH" -c "$PIN" "${DEPS[@]}" "${OWN[@]}"; then
    rm -f "$WH"/torch-*.whl
    echo "$WANT" > "$WH/.complete"
  else
    echo "setup_env: wheelhouse incomplete; installing from the registry" >&2
  fi
fi
install() {   # from the wheelhouse; whatever it lacks, from the registry
  $PIP install -q -c "$PIN" --no-index --find-links "$WH" "$@" 2>/dev/null || $PIP install -q -c "$PIN" "$@"
}
# torch first, from the local CPU build, so nothing below pulls a CUDA build
$PIP install -q torch==2.13.0
install --no-deps "${NODEPS[@]}"
install "${DEPS[@]}" "${OWN[@]}"
# kvatlas, editable: its vllm.general_plugins entry point then names this checkout
$PIP install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -W ignore -c "import vllm.v1.core.sched.scheduler, vllm.plugins, kvatlas.integrations.vllm"
touch "$STAMP"
echo "vllm venv built in $(( $(date +%s) - start )) s: $VENV"
