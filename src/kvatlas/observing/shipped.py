"""Files kvatlas ships for operators: a Grafana dashboard, Prometheus recording rules and alerts
(with their promtool unit tests), and a JSON Schema for every document kvatlas prints or serves.

They live in the package (`observing/assets/`); `kvatlas observe` prints one, its path, or writes
them all to a folder. A document names its schema with two fields, `"schema"` and
`"schema_version"`, and the pair names the file: `schemas/<schema>.v<version>.schema.json`
(`schema_path`). `kvatlas models --json` is an array and carries no fields; its schema is
`kvatlas.models` version 1. A field added to a document is added to its schema in the same
change; a field removed, renamed or changed in meaning bumps the document's schema_version and
ships a new file beside the old one.
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


def names() -> list[str]:
    """Every name `path` and `read` take: the files, then the schemas (`kvatlas.plan`, …)."""
    return list(FILES) + sorted({s for s, _ in SCHEMAS})


def schema_path(schema: str, version: int | None = None) -> str:
    """The shipped schema file of a document's `schema` and `schema_version` (default: the newest)."""
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
    if name in FILES:
        return os.path.join(ASSETS_DIR, FILES[name])
    if name.startswith("kvatlas."):
        return schema_path(name)
    raise ConfigError("name", f"{name!r} is not a shipped file", "use one of " + ", ".join(names()))


def read(name: str) -> str:
    with open(path(name), encoding="utf-8") as fh:
        return fh.read()


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
    """A jsonschema validator for the schema `doc` names, with the other shipped schemas it
    refers to ($ref by file name) resolved from the package. Needs the `jsonschema` package."""
    import jsonschema
    from referencing import Registry, Resource
    resources = []
    for f in SCHEMAS.values():
        with open(os.path.join(ASSETS_DIR, "schemas", f), encoding="utf-8") as fh:
            resources.append((f, Resource.from_contents(json.load(fh))))
    schema = schema_for(doc)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, registry=Registry().with_resources(resources))


def write_all(folder: str) -> list[str]:
    """Copy every shipped file into `folder` (grafana/, prometheus/, schemas/); the paths written."""
    out = []
    sources = [os.path.join(ASSETS_DIR, f) for f in FILES.values()]
    sources += [os.path.join(ASSETS_DIR, "schemas", f) for f in SCHEMAS.values()]
    for src in sources:
        dst = os.path.join(folder, os.path.relpath(src, ASSETS_DIR))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        out.append(dst)
    return out
