"""Every shell and Python example of README.md and of each page of the documentation site (docs/)
runs as written, on CPU.

The Python blocks of one page run in order in one fresh interpreter (later examples use earlier
ones' names, as a reader pasting them into one session would); the shell blocks run with `bash -e`
in a scratch directory, the `kvatlas` of this environment first on PATH. A block after
`<!-- readme-test: cuda -->` runs only where CUDA is; one after `<!-- readme-test: setup -->`
(creating a virtual environment and installing) runs, in a fresh copy of the project, only with
KVATLAS_SLOW_TESTS=1: it installs torch and the dependencies, which takes minutes, and CI's own
`.ci/run` runs that same command on every push. `<!-- readme-test: sketch -->` marks a fragment
that shows a call shape with an engine's tensors it does not define (write_layer's): not run, and
kept to one (test_readme_has_examples_of_every_kind) so runnable examples stay the rule.
`<!-- readme-test: sglang -->` and `<!-- readme-test: vllm -->` mark the engines' launches (each
needs the engine, a GPU and the model's weights); the plugins' own tests cover what they do.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- readme-test: (\w+) -->\n)?```(bash|python)\n(.*?)```", re.S)


PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def blocks(lang: str, tag: str | None = None, page: str = "README.md") -> list[str]:
    text = (ROOT / page).read_text()
    return [body for t, lg, body in FENCE.findall(text) if lg == lang and (t or None) == tag]


def all_blocks(lang: str, tag: str | None = None) -> list[tuple[str, int]]:
    return [(p, i) for p in PAGES for i in range(len(blocks(lang, tag, p)))]


def has_cuda() -> bool:
    try:
        import torch
    except ModuleNotFoundError:
        return False
    return torch.cuda.is_available()


def env_with_kvatlas() -> dict:
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT / "src")}


def test_readme_has_examples_of_every_kind():
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 2 and len(blocks("bash", "setup")) == 2
    assert sum(len(blocks("python", "sketch", p)) for p in PAGES) <= 1
    tags = set(t for t, _, _ in FENCE.findall((ROOT / "README.md").read_text()) if t)
    assert tags <= {"setup", "cuda", "sketch", "sglang", "vllm"}, tags   # each tag is explained in this file
    shell = "\n".join(blocks("bash"))
    for cmd in ("kvatlas alloc", "kvatlas simulate", "kvatlas serve"):
        assert cmd in shell


def test_docs_examples_are_tagged_known_ways():
    for page in PAGES:
        tags = set(t for t, _, _ in FENCE.findall((ROOT / page).read_text()) if t)
        assert tags <= {"setup", "cuda", "sketch", "sglang", "vllm"}, (page, tags)
        if page != "README.md":
            assert not blocks("bash", "setup", page), f"{page}: the set-up commands live in README.md"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks("python", page=p) or blocks("python", "cuda", p)])
def test_python_examples_run(tmp_path, page):
    pytest.importorskip("torch")
    code = "\n\n".join(blocks("python", page=page) + (blocks("python", "cuda", page) if has_cuda() else []))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env_with_kvatlas(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (page, r.stderr[-3000:])


@pytest.mark.parametrize("page,i", all_blocks("bash"))
def test_shell_examples_run(tmp_path, page, i):
    pytest.importorskip("torch")
    script = blocks("bash", page=page)[i]
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env_with_kvatlas(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, (script, r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.skipif(not os.environ.get("KVATLAS_SLOW_TESTS"), reason="creates a venv and installs: set KVATLAS_SLOW_TESTS=1")
@pytest.mark.parametrize("i", range(2))
def test_setup_commands_in_a_fresh_environment(tmp_path, i):
    project = tmp_path / "kvatlas"
    shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info"))
    script = blocks("bash", "setup")[i]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    if i == 1:   # the test command would run this very test again: everything but that
        script = script.replace("python -m pytest -q", "python -m pytest -q -x tests/test_plan.py")
    r = subprocess.run(["bash", "-e", "-c", script], cwd=project, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
