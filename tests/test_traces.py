"""Traces with prefix structure: deterministic token ids for block ids, the Mooncake format, and a
reader that streams, bounds its lines and reports every bad line by number."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kvatlas.driving.content import BLOCK_TOKENS, VOCAB_SIZE, block_tokens, prefix_ceiling_blocks, prompt_tokens_of
from kvatlas.driving.traces import TraceError, iter_trace, read_trace, write_trace
from kvatlas.driving.workload import Request
from kvatlas.errors import ConfigError

MOONCAKE = str(Path(__file__).parent / "data" / "mooncake_head.jsonl")   # the first 200 lines


def test_equal_block_ids_give_equal_tokens_and_different_ids_differ():
    a = block_tokens([7, 8, 9])
    b = block_tokens([9, 7])
    assert a.dtype == np.int32 and a.shape == (3 * BLOCK_TOKENS,) and a.flags.c_contiguous
    assert np.array_equal(a[2 * BLOCK_TOKENS:], b[:BLOCK_TOKENS])       # block 9 in two places
    assert np.array_equal(a[:BLOCK_TOKENS], b[BLOCK_TOKENS:])           # block 7 likewise
    assert not np.array_equal(a[:BLOCK_TOKENS], a[BLOCK_TOKENS:2 * BLOCK_TOKENS])
    assert 0 <= a.min() and a.max() < VOCAB_SIZE
    assert len(np.unique(a)) > 1400                                     # not a constant or a short cycle
    many = block_tokens(np.arange(2000))                                # uniform over the vocabulary
    assert len(np.unique(many)) > 129_000 and np.bincount(many % 8).min() > 127_000


def test_tokens_are_a_fixed_function_of_the_block_id():
    # the values themselves are pinned: another process, machine or numpy version must give the
    # same, or replays of one trace would stop sharing a cache's keys
    first = block_tokens([0])[:4].tolist()
    assert first == [93358, 75266, 119021, 74629]
    assert block_tokens([43923])[-3:].tolist() == [68846, 3235, 97982]
    assert block_tokens([0], seed=1)[:4].tolist() == [50555, 3532, 74082, 10956]
    again = block_tokens([3, 0, 5])[BLOCK_TOKENS:BLOCK_TOKENS + 4].tolist()
    assert again == first


def test_a_partial_block_is_a_prefix_of_the_whole_block():
    whole = block_tokens([42])
    for n in (0, 1, 255, 511):
        assert np.array_equal(block_tokens([42], [n]), whole[:n])
    mixed = block_tokens([1, 2, 3], [10, 512, 3])
    assert np.array_equal(mixed, np.concatenate([block_tokens([1])[:10], block_tokens([2]), block_tokens([3])[:3]]))


def test_prompt_tokens_cut_the_last_block():
    toks = prompt_tokens_of([5, 6, 7], None, 1100)
    assert toks.shape == (1100,) and np.array_equal(toks, block_tokens([5, 6, 7])[:1100])
    with pytest.raises(ValueError, match="fewer"):
        prompt_tokens_of([5], None, 513)
    with pytest.raises(ValueError, match="≥ 0"):
        block_tokens([-1])
    with pytest.raises(ValueError, match="0..512"):
        block_tokens([1], [513])


def test_request_token_ids():
    plain = Request(id="a", arrival_s=0, prompt_tokens=5, output_tokens=1)
    assert plain.token_ids() is None
    r1 = Request(id="b", arrival_s=0, prompt_tokens=600, output_tokens=1, blocks=(3, 4))
    r2 = Request(id="c", arrival_s=1, prompt_tokens=1024, output_tokens=1, blocks=(3, 9))
    t1, t2 = r1.token_ids(), r2.token_ids()
    assert t1.shape == (600,) and t2.shape == (1024,)
    assert np.array_equal(t1[:512], t2[:512]) and not np.array_equal(t1[512:600], t2[512:600])


def _mooncake_lines(n):
    with open(MOONCAKE) as fh:
        return [json.loads(fh.readline()) for _ in range(n)]


def test_mooncake_lines_parse_to_requests(tmp_path):
    reqs, problems = read_trace(MOONCAKE)
    assert problems == [] and len(reqs) == 200
    lines = _mooncake_lines(3)
    r = [x for x in reqs if x.id == "line3"][0]
    assert (r.arrival_s, r.prompt_tokens, r.output_tokens) == (0.040, 23769, 3)
    assert r.blocks == tuple(lines[2]["hash_ids"]) == tuple(range(151, 198)) and r.block_lens is None
    assert r.token_ids().shape == (23769,)
    # explicit format, same result; the kvatlas format refuses these lines by name
    assert read_trace(MOONCAKE, fmt="mooncake")[0] == reqs
    bad, problems = read_trace(MOONCAKE, fmt="kvatlas")
    assert bad == [] and len(problems) == 200 and "'arrival_s'" in problems[0][1]


def test_mooncake_shared_prefix_gives_shared_tokens():
    reqs = {r.id: r for r in read_trace(MOONCAKE)[0]}
    # find two requests whose hash ids start alike and check their tokens do too, up to the divergence
    by_first = {}
    for r in reqs.values():
        by_first.setdefault(r.blocks[0], []).append(r)
    a, b = next(v for v in by_first.values() if len(v) >= 2)[:2]
    common = next(i for i, (x, y) in enumerate(zip(a.blocks + (-1,), b.blocks + (-2,))) if x != y)
    shared_tokens = min(common * BLOCK_TOKENS, a.prompt_tokens, b.prompt_tokens)
    ta, tb = a.token_ids(), b.token_ids()
    assert shared_tokens >= BLOCK_TOKENS
    assert np.array_equal(ta[:shared_tokens], tb[:shared_tokens])
    if common * BLOCK_TOKENS < min(a.prompt_tokens, b.prompt_tokens):
        assert not np.array_equal(ta[shared_tokens:shared_tokens + 16], tb[shared_tokens:shared_tokens + 16])


BAD_MOONCAKE = """{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
{"timestamp": -5, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
{"timestamp": 10, "input_length": 600, "output_length": 2, "hash_ids": [1]}
{"timestamp": 10, "input_length": 600, "output_length": 2, "hash_ids": [1, -2]}
{"timestamp": 10, "input_length": 0, "output_length": 2, "hash_ids": []}
{"timestamp": 10, "input_length": 5, "output_length": true, "hash_ids": [1]}
{"timestamp": 10, "input_length": 5, "output_length": 1, "hash_ids": "1"}
{"timestamp": 20, "input_length": 1024, "output_length": 1, "hash_ids": [1, 3]}
"""


def test_bad_mooncake_lines_are_reported_by_number(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(BAD_MOONCAKE)
    reqs, problems = read_trace(str(path))
    assert [r.id for r in reqs] == ["line1", "line8"]
    assert [n for n, _ in problems] == [2, 3, 4, 5, 6, 7]
    msgs = [m for _, m in problems]
    assert "'timestamp'" in msgs[0] and "milliseconds" in msgs[0]
    assert "'hash_ids' has 1 ids" in msgs[1] and "ceil(600 / 512) = 2" in msgs[1]
    assert "'hash_ids'" in msgs[2] and "'input_length'" in msgs[3] and "'output_length'" in msgs[4]
    assert "'hash_ids'" in msgs[5]
    with pytest.raises(TraceError) as exc:
        read_trace(str(path), strict=True)
    assert exc.value.line_no == 2 and "hash_ids" in str(exc.value)   # the fix shows the format


def test_duplicate_ids_are_reported_with_both_line_numbers_and_the_run_goes_on(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
                    '{"id": "b", "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1}\n'
                    '{"id": "a", "arrival_s": 2, "prompt_tokens": 6, "output_tokens": 1}\n'
                    '{"arrival_s": 3, "prompt_tokens": 7, "output_tokens": 1}\n'
                    '{"id": "line4", "arrival_s": 3, "prompt_tokens": 7, "output_tokens": 1}\n'
                    '{"id": 7, "arrival_s": 4, "prompt_tokens": 7, "output_tokens": 1}\n')
    reqs, problems = read_trace(str(path))
    assert [r.id for r in reqs] == ["a", "b", "line4", "7"]
    assert problems == [(3, "id 'a' repeats line 1; give each request its own id"),
                        (5, "id 'line4' repeats line 4; give each request its own id")]
    with pytest.raises(TraceError) as exc:
        read_trace(str(path), strict=True)
    assert exc.value.line_no == 3 and "repeats line 1" in str(exc.value)


def test_over_long_lines_are_bounded_reported_and_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    good = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}'
    long = '{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1, "pad": "' + "x" * 5000 + '"}'
    path.write_text(good + "\n" + long + "\n" + good.replace("0,", "2,") + "\n")
    reqs, problems = read_trace(str(path), max_line_bytes=200)
    assert [r.id for r in reqs] == ["line1", "line3"]
    assert problems == [(2, f"line of {len(long) + 1:,} bytes is longer than the 200-byte bound; "
                            "write one request per line")]
    # a line exactly at the bound (newline included) is read
    exact = good + " " * (200 - len(good) - 1)
    path.write_text(exact + "\n")
    assert len(read_trace(str(path), max_line_bytes=200)[0]) == 1


def test_a_trace_without_newlines_is_not_read_whole(tmp_path):
    path = tmp_path / "one_line.jsonl"
    path.write_bytes(b"[" + b"1," * 4_000_000 + b"1]")      # 8 MB, no newline
    tracemalloc.start()
    try:
        reqs, problems = read_trace(str(path), max_line_bytes=1 << 16)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert reqs == [] and len(problems) == 1 and problems[0][0] == 1 and "8,000,003 bytes" in problems[0][1]
    assert peak < 1 << 20                                   # a bounded read: far below the file's 8 MB


def test_a_non_utf8_trace_is_refused_cleanly(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary\n\x00\x81\n")
    with pytest.raises(ConfigError) as exc:
        read_trace(str(path))
    assert "not UTF-8 text" in str(exc.value) and "line 1" in str(exc.value) and "0x8b" in str(exc.value)
    # one bad line in the middle of a text trace is a bad line like any other
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"arrival_s": "\xff"}\n')
    reqs, problems = read_trace(str(path))
    assert len(reqs) == 1 and problems == [(2, "not UTF-8 (byte 0xff at column 16)")]


def test_a_byte_order_mark_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\r\n'
                     b'{"arrival_s": 1, "prompt_tokens": 6, "output_tokens": 1}\r\n')
    reqs, problems = read_trace(str(path))
    assert problems == [] and [r.prompt_tokens for r in reqs] == [5, 6]


def test_iter_trace_streams_in_file_order(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 5, "prompt_tokens": 5, "output_tokens": 1}\n' * 3)
    it = iter_trace(str(path))
    assert next(it).id == "line1"                        # one request read, not the whole file
    assert [r.id for r in it] == ["line2", "line3"]
    with pytest.raises(ConfigError, match="trace_format"):
        next(iter_trace(str(path), fmt="csv"))


def test_content_and_session_links_round_trip(tmp_path):
    reqs = [Request(id="s0", arrival_s=0.0, prompt_tokens=700, output_tokens=5, blocks=(1, 2), block_lens=(512, 200)),
            Request(id="s1", arrival_s=0.0, prompt_tokens=800, output_tokens=5, blocks=(1, 2, 3, 4),
                    block_lens=(512, 200, 5, 83), after="s0", think_s=2.5)]
    path = tmp_path / "t.jsonl"
    write_trace(str(path), reqs)
    back, problems = read_trace(str(path))
    assert back == reqs and problems == []
    assert np.array_equal(back[1].token_ids()[:700], back[0].token_ids())


def test_bad_content_and_links(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "x", "arrival_s": 0, "prompt_tokens": 600, "output_tokens": 1, "blocks": [1]}\n'
                    '{"id": "y", "arrival_s": 0, "prompt_tokens": 6, "output_tokens": 1, "blocks": [1], "block_lens": [2]}\n'
                    '{"id": "z", "arrival_s": 0, "prompt_tokens": 6, "output_tokens": 1, "after": "w"}\n'
                    '{"id": "w", "arrival_s": 0, "prompt_tokens": 6, "output_tokens": 1, "block_lens": [6]}\n')
    reqs, problems = read_trace(str(path))
    assert reqs == []
    assert problems == [(1, "'blocks' cover 512 tokens, fewer than 'prompt_tokens' 600"),
                        (2, "'blocks' cover 2 tokens, fewer than 'prompt_tokens' 6"),
                        (3, "'after' 'w' names no request on an earlier line"),
                        (4, "'block_lens' needs 'blocks'")]


def test_simulate_replays_a_mooncake_trace_with_books_only(tmp_path, capsys):
    from kvatlas.cli import main
    args = ["simulate", "deepseek-v4-flash", "--memory", "16GiB", "--backend", "none", "--workload", MOONCAKE,
            "--max-steps", "40", "--no-plot", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "NO POOL TENSORS (backend none)" in out and "prefilled" in out
    assert main(args + ["--trace-format", "kvatlas"]) == 2        # every line refused: no request left
    err = capsys.readouterr().err
    assert f"{MOONCAKE}:1: skipped: 'arrival_s'" in err and "180 more lines skipped, the last on line 200" in err
    assert "holds no request (200 lines skipped)" in err


def test_prefix_ceiling_counts_leading_blocks_seen_before():
    def r(rid, blocks):
        return Request(id=rid, arrival_s=0, prompt_tokens=BLOCK_TOKENS * len(blocks), output_tokens=1, blocks=blocks)
    reqs = [r("a", (1, 2, 3)), r("b", (1, 2, 4)), r("c", (5, 1)), r("d", (1, 2, 3, 6)),
            Request(id="e", arrival_s=0, prompt_tokens=5, output_tokens=1)]
    assert prefix_ceiling_blocks(reqs) == (0 + 2 + 0 + 3, 3 + 3 + 2 + 4)
    hit, total = prefix_ceiling_blocks(read_trace(MOONCAKE)[0])
    assert total == sum(len(x["hash_ids"]) for x in _mooncake_lines(200)) and 0 < hit < total


@pytest.mark.parametrize("kw, field", [({"prompt_tokens": 0}, "prompt_tokens"), ({"output_tokens": 1.5}, "output_tokens"),
                                       ({"arrival_s": float("nan")}, "arrival_s"), ({"think_s": -1}, "think_s"),
                                       ({"blocks": (1,), "prompt_tokens": 513}, "blocks"),
                                       ({"block_lens": (5,)}, "block_lens"),
                                       ({"blocks": (1, 2), "block_lens": (5,)}, "block_lens")])
def test_requests_refuse_values_that_would_break_a_run(kw, field):
    args = dict(id="r", arrival_s=0.0, prompt_tokens=5, output_tokens=1) | kw
    with pytest.raises(ConfigError) as exc:
        Request(**args)
    assert exc.value.field == field and "'r'" in str(exc.value)


def test_a_kvatlas_line_with_a_stray_timestamp_stays_kvatlas(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 1.5, "prompt_tokens": 700, "output_tokens": 8, "timestamp": 99}\n'
                    '{"timestamp": 250, "input_length": 600, "output_length": 4, "hash_ids": [0, 2]}\n')
    (a, b), bad = read_trace(str(path))
    assert bad == [] and (a.arrival_s, a.prompt_tokens, a.blocks) == (0.25, 600, (0, 2))   # the Mooncake line
    assert (b.arrival_s, b.prompt_tokens, b.blocks) == (1.5, 700, None)                    # kvatlas's, its own time
