"""The integration package without SGLang: the plugin refuses cleanly, the core never imports an
engine, and the foreign ledger's measures (pure bookkeeping, no engine needed)."""

import logging
import pathlib
import re

import pytest

from kvatlas.engines.base import EngineBuffer, paged_buffer
from kvatlas.integrations import foreign
from kvatlas.integrations.sglang import plugin as ks
from kvatlas.planning import formats

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "kvatlas"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_only_an_engines_own_modules_import_it(engine):
    # the package integrations/<engine>/ holds every fact about that engine
    pattern = re.compile(rf"^\s*(import {engine}\b|from {engine}\b)", re.M)
    own = SRC / "integrations" / engine
    importers = [p for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert any(p.parent == own for p in importers)      # the pattern finds the engine's own imports
    assert [str(p.relative_to(SRC)) for p in importers if p.parent != own] == []


def test_nothing_below_integrations_imports_transformers():
    """transformers is an optional extra: only kvatlas.integrations.transformers imports it (and
    `import kvatlas` never does)."""
    pattern = re.compile(r"^\s*(import transformers|from transformers)", re.M)
    offenders = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                 if "transformers" not in p.relative_to(SRC).parts[:2] if pattern.search(p.read_text())]
    assert offenders == []
    import subprocess
    import sys
    code = "import kvatlas, kvatlas.datapath, kvatlas.prefix, kvatlas.tiers, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("version", [None, "0.5.24"])
def test_register_refuses_other_versions_with_one_line(monkeypatch, caplog, version):
    monkeypatch.setattr(ks, "sglang_version", lambda: version)
    with caplog.at_level(logging.INFO, logger="kvatlas"):
        assert ks.register() is False
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and "plugin off, SGLang runs unchanged" in rec.getMessage()
    assert (version or "(not installed)") in rec.getMessage()


def test_state_port_setting(caplog):
    assert ks.Settings.from_env({}).state_port is None
    assert ks.Settings.from_env({ks.STATE_PORT_ENV: "9411"}).state_port == 9411
    with caplog.at_level(logging.WARNING, logger="kvatlas"):
        assert ks.Settings.from_env({ks.STATE_PORT_ENV: "http"}).state_port is None
    assert "not a port" in caplog.text


def _kv_buffer(pages=10, reachable=7):
    spec = paged_buffer("c4_kv", pool="c4_kv", role="kv", kind="c4", layers=(2, 4), fmt=formats.FP8_DS_MLA,
                        entries=64, pages=pages, group="full_pages")
    layout = EngineBuffer(spec=spec, unreachable_units=pages - 1 - reachable)
    return foreign.ForeignBuffer(layout=layout, tensor_bytes=layout.bytes, reserved_bytes=layout.bytes,
                                 physical_bytes=layout.bytes, planned_bytes=7 * 2 * 37_440, index_space="full_pages",
                                 bytes_per_used_unit=spec.unit_payload_bytes, in_kv_cache=True)


def test_foreign_ledger_measures_follow_the_engine_counters():
    used = {"full_pages": 0}
    ledger = foreign.ForeignLedger(engine="x", buffers=[_kv_buffer()], used_units=lambda: dict(used),
                                   units_total={"full_pages": 7}, labels={"tp_rank": "0"}, budget_bytes=700_000,
                                   in_budget_pools=frozenset({"c4_kv"}))
    m = ledger.snapshot().pools["c4_kv"].measures
    assert (m.tensor_bytes, m.addressable_bytes, m.occupied_bytes) == (10 * 2 * 37_440, 7 * 2 * 64 * 583, 0)
    assert ledger.unreachable_bytes == 2 * 2 * 37_440 and ledger.over_budget_bytes == 748_800 - 700_000
    used["full_pages"] = 3
    snap = ledger.snapshot()
    assert snap.pools["c4_kv"].measures.occupied_bytes == 3 * 2 * 64 * 583 and snap.pools["c4_kv"].units_used == 3
    assert snap.kv_cache == snap.total and snap.pools["c4_kv"].measures.violations("c4_kv") == []


def test_a_layout_that_does_not_match_the_tensors_claims_nothing_unreachable():
    b = _kv_buffer()
    odd = foreign.ForeignBuffer(**{**{f: getattr(b, f) for f in b.__slots__}, "tensor_bytes": b.tensor_bytes + 512})
    assert not odd.layout_matches and odd.unreachable_bytes == 0 and odd.addressable_bytes == odd.tensor_bytes


def test_audit_cli_without_sglang_names_the_fix(capsys, monkeypatch):
    from kvatlas.cli import main
    monkeypatch.setattr(ks, "sglang_version", lambda: None)
    assert main(["audit", "--sglang", "--memory", "4GiB"]) == 2
    err = capsys.readouterr().err
    assert "SGLang (not installed) is not 0.5.23" in err and "pip install --no-deps sglang==0.5.23" in err
