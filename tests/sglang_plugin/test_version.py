"""Any SGLang but 0.5.23 is refused with one log line and no hook, through SGLang's own loader."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging
    logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    print("HOOKS", sorted(t for t, hooks in HookRegistry._hooks.items() if hooks))
""")


def test_a_different_sglang_version_is_refused_with_one_line(tmp_path):
    # a distribution record for another release, found first on the path: what
    # importlib.metadata (and so the plugin) reports as the installed SGLang
    dist = tmp_path / "sglang-0.5.24.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith("kvatlas.integrations.sglang|")]
    assert ours == ["kvatlas.integrations.sglang|kvatlas: SGLang 0.5.24 is not 0.5.23, the version this plugin "
                    "knows; plugin off, SGLang runs unchanged"]
    assert "HOOKS []" in out.stdout
