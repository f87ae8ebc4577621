# Sourced by tests/<engine>_plugin/setup_env.sh: the virtual environment one engine's plugin tests
# run in, that engine installed without its pins against the local CPU torch 2.13.0.
#
# The caller sets ENGINE, VERSION, VENV, PY and three arrays: NODEPS (installed with --no-deps: the
# engine itself), DEPS (its import chain, resolved) and OWN (kvatlas's and its tests' needs). Wheels
# are downloaded once into a wheelhouse outside the checkout (KVATLAS_WHEELHOUSE, default
# ~/.cache/kvatlas/ENGINE-VERSION-wheels): pip keeps no cache on these machines, and the download
# dominates a cold build. Its stamp names the lists it was filled for, so a changed list fills in
# what is missing; whatever it lacks is installed from the registry as usual (a missing or partial
# wheelhouse only costs time). torch is pinned to 2.13.0 throughout, so a dependency that asks for
# torch never pulls a CUDA build (and its nvidia wheels) into the wheelhouse or the venv.

engine_venv_begin() {   # returns 1 (after one line) when the venv is already built
  STAMP="$VENV/.kvatlas-$ENGINE-ready"
  WH="${KVATLAS_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvatlas/$ENGINE-$VERSION-wheels}"
  if [ -f "$STAMP" ]; then echo "$ENGINE venv ready: $VENV"; return 1; fi
  START=$(date +%s)
  "$PY" -m venv "$VENV"
  PIP="$VENV/bin/python -m pip"
  $PIP install -q --upgrade pip >/dev/null
  PIN="$VENV/kvatlas-constraints.txt"
  echo "torch==2.13.0" > "$PIN"
  local want
  want="$(echo "${NODEPS[@]}" "${DEPS[@]}" "${OWN[@]}")"
  if [ "$(cat "$WH/.complete" 2>/dev/null)" != "$want" ]; then
    mkdir -p "$WH"
    if $PIP download -q -d "$WH" --no-deps "${NODEPS[@]}" && $PIP download -q -d "$WH" -c "$PIN" "${DEPS[@]}" "${OWN[@]}"; then
      rm -f "$WH"/torch-*.whl   # the local build, copied by the resolution: it is installed from disk
      echo "$want" > "$WH/.complete"
    else
      echo "setup_env: wheelhouse incomplete; installing from the registry" >&2
    fi
  fi
  # torch first, from the local CPU build, so nothing below pulls a CUDA build
  $PIP install -q torch==2.13.0
  engine_venv_install --no-deps "${NODEPS[@]}"
  engine_venv_install "${DEPS[@]}" "${OWN[@]}"
  # kvatlas, editable: its entry points then name this checkout
  $PIP install -q --no-build-isolation --no-deps -e .
}

engine_venv_install() {   # from the wheelhouse; whatever it lacks, from the registry
  $PIP install -q -c "$PIN" --no-index --find-links "$WH" "$@" 2>/dev/null || $PIP install -q -c "$PIN" "$@"
}

engine_venv_done() {   # $1: the imports that must work
  "$VENV/bin/python" -W ignore -c "$1"
  touch "$STAMP"
  echo "$ENGINE venv built in $(( $(date +%s) - START )) s: $VENV"
}
