"""vLLM integration tests: they run in the venv tests/vllm_plugin/setup_env.sh builds (vLLM 0.33.0 on the
CPU, without its dependencies) and are skipped where vLLM is not installed (tests/conftest.py), e.g. in
the main test run. Helpers: truth.py (vLLM's own state counted the slow way), serve_roles.py (the API
server and engine core in two processes)."""
