"""The package's shape: the public names the README uses, a root that holds only the four shared
modules, imports that flow one way between the story packages, and a plan path free of heavy imports."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import kvatlas

SRC = os.path.join(os.path.dirname(kvatlas.__file__))


def _imports():
    """(importing module, imported module) for every relative import in the package, lazy ones too."""
    for folder, _, files in os.walk(SRC):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(SRC))[:-3].replace(os.sep, ".")
            mod = rel[: -len(".__init__")] if name == "__init__.py" else rel
            pkg = mod if name == "__init__.py" else mod.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    if node.module:
                        yield mod, ".".join(base + [node.module])
                    else:
                        yield from ((mod, ".".join(base + [a.name])) for a in node.names)


def _story(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_public_names_the_readme_uses():
    for name in ["plan", "allocate", "audit", "load_model", "budget_for", "max_concurrency", "preset_names",
                 "Plan", "ModelSpec", "LayerKind", "ServeOptions", "formats", "datapath", "server", "engines",
                 "KvatlasError", "ConfigError", "BudgetError", "PoolExhaustedError", "RequestStateError"]:
        assert getattr(kvatlas, name) is not None, name
    assert callable(kvatlas.plan) and callable(kvatlas.server.start)
    from kvatlas import formats, server  # noqa: F401  README: data path and /state examples
    from kvatlas.datapath import CODECS, PageGeometry, gather, store  # noqa: F401
    from kvatlas.engines import compare, run_engine  # noqa: F401
    assert formats.LAYOUTS and server.STATE_SCHEMA_VERSION >= 1


def test_root_holds_only_the_shared_modules():
    modules = sorted(f for f in os.listdir(SRC) if f.endswith(".py"))
    assert modules == ["__init__.py", "__main__.py", "checks.py", "errors.py", "units.py"]


def test_story_packages_import_one_way():
    graph: dict[str, set[str]] = {}
    for a, b in _imports():
        if _story(a) != _story(b) and _story(a) != "<root>":
            graph.setdefault(_story(a), set()).add(_story(b))
    # depth-first search for a cycle between packages
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join(path + [nxt])}"
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2
    for node in list(graph):
        if node not in state:
            visit(node, [node])


def test_plan_path_imports_nothing_heavy():
    code = ("import sys\nfrom kvatlas.cli import main\n"
            "try:\n    main(['plan', 'deepseek-v4-flash', '--memory', '120GiB'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'rich', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# Module by module (issue 39): every import, at module level or inside a function, is an arrow; a
# strongly connected set of more than one module is a circle. `from pkg import name` points at
# `pkg.name` where that is a module, else at `pkg` (its __init__).
_SRC = Path(SRC).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((_SRC / "kvatlas").rglob("*.py")):
        parts = list(path.relative_to(_SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _arrows(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in known:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    mods = _modules()
    graph = {name: _arrows(name, path, set(mods)) for name, path in mods.items()}
    assert sum(map(len, graph.values())) > 200      # the walk saw the package's imports
    assert _circles(graph) == []


def test_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
