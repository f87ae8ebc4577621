"""Boards: metric samples written in one process, exported by another's Prometheus registry (the vLLM
plugin's path from the engine core to the API server's /metrics). No engine needed."""

import json
import os
import struct
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvatlas.integrations.boards import Board, BoardCollector, read_boards

KEYS = [("kvatlas_pool_used_blocks", ("pool", "engine"), ("mla", "vllm")),
        ("kvatlas_pool_used_blocks", ("pool", "engine"), ("swa.0", "vllm")),
        ("kvatlas_kv_cache_total_bytes", ("measure", "engine"), ("tensor", "vllm"))]


def _scrape(directory) -> dict:
    reg = CollectorRegistry()
    reg.register(BoardCollector(str(directory)))
    text = generate_latest(reg).decode()
    assert "# HELP kvatlas_pool_used_blocks Blocks of vLLM's shared KV block pool" in text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_written_values_reach_the_registry(tmp_path):
    board = Board(str(tmp_path), "vllm-dp0", KEYS)
    board.write([3, 5, 128_848_976_640])
    got = _scrape(tmp_path)
    assert got[("kvatlas_pool_used_blocks", (("engine", "vllm"), ("pool", "mla")))] == 3
    assert got[("kvatlas_kv_cache_total_bytes", (("engine", "vllm"), ("measure", "tensor")))] == 128_848_976_640
    import numpy as np
    board.write(np.array([4.0, 6.0, 1.0]))      # the plugin writes a float64 array in place
    assert [v for _, v in read_boards(str(tmp_path))] == [4.0, 6.0, 1.0]
    board.close()
    assert read_boards(str(tmp_path)) == [] and os.listdir(tmp_path) == []


def test_a_board_never_written_or_mid_write_is_not_read(tmp_path):
    board = Board(str(tmp_path), "vllm-dp0", KEYS)
    assert read_boards(str(tmp_path)) == []     # sequence 0: nothing written yet
    board.write([1, 2, 3])
    struct.pack_into("<Q", board._map, 0, 3)    # a writer caught between its two counter bumps
    assert read_boards(str(tmp_path)) == []
    board.write([1, 2, 3])
    assert len(read_boards(str(tmp_path))) == 3
    board.close()


def test_a_dead_processs_board_is_skipped(tmp_path):
    code = ("import sys; from kvatlas.integrations.boards import Board; "
            f"b = Board(sys.argv[1], 'vllm-dp1', {KEYS!r}); b.write([1, 2, 3]); print(b.paths[0])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    head = json.load(open(out.stdout.strip()))   # the files stay (no close): the process exited
    assert head["pid"] != os.getpid() and read_boards(str(tmp_path)) == []
    assert read_boards(str(tmp_path / "missing")) == []
