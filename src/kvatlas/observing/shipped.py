"""Files kvatlas ships for operators: a Grafana dashboard, Prometheus recording rules and alerts
(with their promtool unit tests), and a JSON Schema for every document kvatlas prints or serves.

They live in the package (`observing/assets/`); `kvatlas observe` prints one, its path, or writes
them all to a folder. A document names its schema with two fields, `"schema"` and
`"schema_version"`, and the pair names the file: `schemas/<schema>.v<version>.schema.json`
(`schema_path`). `kvatlas models --json` is an array and carries no fields; its schema is
`kvatlas.models` version 1. A field added to a document is added to its schema in the same
change; a field removed, renamed or changed in meaning bumps the document's schema_version and
ships a new file beside the old one.

In the package a schema refers to another by its file name (`"$ref":
"kvatlas.ledger.v1.schema.json"`), so each document's schema is written once. What leaves the
package — `read` (what `kvatlas observe NAME` prints), `write_all` and `validator` — is the
bundled form (`bundled`): every schema it refers to copied under `$defs` and each `$ref` pointed
there, so any JSON Schema validator checks a document with that one file and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil

from ..errors import ConfigError

ASSETS_DIR = os.path.join(os.path.dirname(__file__), "assets")

FILES = {
    "dashboard": "grafana/kvatlas-dashboard.json",
    "rules": "prometheus/kvatlas-rules.yml",
    "rules-test": "prometheus/kvatlas-rules.test.yml",
}

# (schema, version) -> file under schemas/
SCHEMAS = {
    ("kvatlas.plan", 1): "kvatlas.plan.v1.schema.json",
    ("kvatlas.compare", 1): "kvatlas.compare.v1.schema.json",
    ("kvatlas.ledger", 1): "kvatlas.ledger.v1.schema.json",
    ("kvatlas.state", 1): "kvatlas.state.v1.schema.json",
    ("kvatlas.alloc", 1): "kvatlas.alloc.v1.schema.json",
    ("kvatlas.host_tier", 1): "kvatlas.host_tier.v1.schema.json",
    ("kvatlas.host_plan", 1): "kvatlas.host_plan.v1.schema.json",
    ("kvatlas.shared_tier", 1): "kvatlas.shared_tier.v1.schema.json",
    ("kvatlas.models", 1): "kvatlas.models.v1.schema.json",
    ("kvatlas.foreign_ledger", 1): "kvatlas.foreign_ledger.v1.schema.json",
    ("kvatlas.foreign_state", 1): "kvatlas.foreign_state.v1.schema.json",
    ("kvatlas.tune", 1): "kvatlas.tune.v1.schema.json",
    ("kvatlas.route_state", 1): "kvatlas.route_state.v1.schema.json",
}


def _name_arg(name, what: str = "name") -> str:
    if not isinstance(name, str):
        raise ConfigError(what, f"{name!r} is not a name", "give a string such as 'dashboard' or 'kvatlas.plan'")
    if not name.strip():
        raise ConfigError(what, "is empty", "use one of " + ", ".join(names()))
    return name


def names() -> list[str]:
    """Every name `path` and `read` take: the files, then the schemas (`kvatlas.plan`, …)."""
    return list(FILES) + sorted({s for s, _ in SCHEMAS})


def schema_path(schema: str, version: int | None = None) -> str:
    """The shipped schema file of a document's `schema` and `schema_version` (default: the newest)."""
    _name_arg(schema, "schema")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ConfigError("schema_version", f"{version!r} is not a version number", "give an integer such as 1, or None")
    versions = sorted(v for s, v in SCHEMAS if s == schema)
    if not versions:
        raise ConfigError("schema", f"{schema!r} has no shipped schema",
                          "use one of " + ", ".join(n for n in names() if n.startswith("kvatlas.")))
    v = versions[-1] if version is None else version
    if (schema, v) not in SCHEMAS:
        raise ConfigError("schema_version", f"{schema} version {v!r} is not shipped",
                          f"use a version in {versions}, or a newer kvatlas")
    return os.path.join(ASSETS_DIR, "schemas", SCHEMAS[(schema, v)])


def path(name: str) -> str:
    """The file of a shipped name: dashboard, rules, rules-test, or a schema name."""
    _name_arg(name)
    if name in FILES:
        return os.path.join(ASSETS_DIR, FILES[name])
    if name.startswith("kvatlas."):
        return schema_path(name)
    raise ConfigError("name", f"{name!r} is not a shipped file", "use one of " + ", ".join(names()))


def read(name: str) -> str:
    """A shipped file's text; a schema in its bundled form (`bundled`)."""
    where = path(name)
    if name.startswith("kvatlas."):
        return json.dumps(bundled(name), indent=2) + "\n"
    with open(where, encoding="utf-8") as fh:
        return fh.read()


def bundled(schema: str, version: int | None = None) -> dict:
    """The schema with every shipped schema it refers to (by file name, at any depth) copied
    under `$defs` by file stem, and each such `$ref` pointed there: one self-contained file."""
    top = load_schema(schema, version)
    files = {f: (s, v) for (s, v), f in SCHEMAS.items()}
    defs, todo = {}, [top]
    while todo:
        node = todo.pop()
        for ref in _file_refs(node):
            stem = ref.removesuffix(".schema.json")
            if stem not in defs and ref in files:
                sub = load_schema(*files[ref])
                sub.pop("$schema", None)
                defs[stem] = sub
                todo.append(sub)
    for node in [top, *defs.values()]:
        _point_refs(node, files)
    if defs:
        top["$defs"] = {**top.get("$defs", {}), **dict(sorted(defs.items()))}
    return top


def _file_refs(node):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            yield ref
        for v in node.values():
            yield from _file_refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _file_refs(v)


def _point_refs(node, files) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in files:
            node["$ref"] = "#/$defs/" + ref.removesuffix(".schema.json")
        for v in node.values():
            _point_refs(v, files)
    elif isinstance(node, list):
        for v in node:
            _point_refs(v, files)


def schema_for(doc) -> dict:
    """The schema a document names (an array is `kvatlas.models` version 1)."""
    if isinstance(doc, list):
        return load_schema("kvatlas.models", 1)
    if not isinstance(doc, dict) or "schema" not in doc or "schema_version" not in doc:
        raise ConfigError("schema", "the document names no schema", "give a kvatlas document with "
                          "'schema' and 'schema_version'")
    return load_schema(doc["schema"], doc["schema_version"])


def load_schema(schema: str, version: int | None = None) -> dict:
    with open(schema_path(schema, version), encoding="utf-8") as fh:
        return json.load(fh)


def validator(doc):
    """A jsonschema validator for the schema `doc` names, in its bundled form (the one file
    `kvatlas observe NAME` prints: nothing else is resolved). Needs the `jsonschema` package."""
    import jsonschema
    schema_for(doc)   # names a shipped schema, or is refused here
    name, version = ("kvatlas.models", 1) if isinstance(doc, list) else (doc["schema"], doc["schema_version"])
    schema = bundled(name, version)
    return jsonschema.validators.validator_for(schema)(schema)


def write_all(folder: str, field: str = "folder") -> list[str]:
    """Copy every shipped file into `folder` (grafana/, prometheus/, schemas/: each schema in
    its bundled form); the paths written. The folder is made if missing; one that cannot be
    (a path under a file, a place that refuses new files such as /proc) is refused, naming
    `field`, before anything is written."""
    _check_folder(folder, field)
    out = []
    for name, rel in FILES.items():
        out.append(_copy(os.path.join(ASSETS_DIR, rel), os.path.join(folder, rel), field))
    for (schema, version), f in SCHEMAS.items():
        dst = os.path.join(folder, "schemas", f)
        _write(dst, json.dumps(bundled(schema, version), indent=2) + "\n", field)
        out.append(dst)
    return out


def _check_folder(folder, field: str) -> None:
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise ConfigError(field, f"{folder!r} is not a folder", "give a folder path such as ./kvatlas-assets")
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(field, f"{folder!r} is a file", "give a folder (it is made if missing)")
    try:
        for sub in ("grafana", "prometheus", "schemas"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
        probe = os.path.join(folder, "schemas", ".kvatlas-write-check")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(field, f"{folder!r} cannot be written ({exc.strerror or exc})",
                          "give a folder you can write to") from None


def _copy(src: str, dst: str, field: str) -> str:
    try:
        shutil.copyfile(src, dst)
    except OSError as exc:
        raise ConfigError(field, f"{dst!r} cannot be written ({exc.strerror or exc})", "give a folder you can write to") from None
    return dst


def _write(dst: str, text: str, field: str) -> None:
    try:
        with open(dst, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise ConfigError(field, f"{dst!r} cannot be written ({exc.strerror or exc})", "give a folder you can write to") from None
