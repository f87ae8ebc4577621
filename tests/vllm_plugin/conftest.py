"""vLLM integration tests: they run in the venv tests/vllm_plugin/setup_env.sh builds (vLLM 0.34.0 on the
CPU, without its dependencies; `KVATLAS_VLLM_VERSION=0.33.0` builds 0.33.0 in .venv-vllm-0.33.0, where
they run the same) and are skipped where vLLM is not installed (tests/conftest.py), e.g. in
the main test run. Helpers: truth.py (vLLM's own state counted the slow way), serve_roles.py (the API
server and engine core in two processes)."""
