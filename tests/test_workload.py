"""Synthetic workloads and JSONL traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.errors import ConfigError, KvatlasError
from kvatlas.driving.traces import TraceError, read_trace, write_trace
from kvatlas.driving.workload import Request, parse_length, synthetic


def test_synthetic_is_seeded_sorted_and_bounded():
    a = synthetic(rate_per_s=50, duration_s=2, prompt="uniform:10:20", output="7", seed=3)
    b = synthetic(rate_per_s=50, duration_s=2, prompt="uniform:10:20", output="7", seed=3)
    c = synthetic(rate_per_s=50, duration_s=2, prompt="uniform:10:20", output="7", seed=4)
    assert a == b and a != c
    assert 50 < len(a) < 160            # Poisson mean 100
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 2
    assert all(10 <= r.prompt_tokens <= 20 and r.output_tokens == 7 for r in a)
    assert len({r.id for r in a}) == len(a)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["exp:50", "lognormal:100:1.5", "uniform:1:3", "1"]), seed=st.integers(0, 10**6))
def test_lengths_are_whole_tokens_at_least_one(kind, seed):
    for r in synthetic(rate_per_s=20, duration_s=1, prompt=kind, output=kind, seed=seed):
        assert isinstance(r.prompt_tokens, int) and r.prompt_tokens >= 1 and r.output_tokens >= 1


@pytest.mark.parametrize("text", ["", "abc", "uniform:5", "uniform:9:3", "exp:0", "gauss:1:2", "0", "lognormal:9:-1"])
def test_bad_length_specs_name_the_field(text):
    with pytest.raises(ConfigError, match="prompt_len"):
        parse_length(text, "prompt_len")


def test_bad_rate_and_duration():
    with pytest.raises(ConfigError, match="rate"):
        synthetic(rate_per_s=0, duration_s=1)
    with pytest.raises(ConfigError, match="duration"):
        synthetic(rate_per_s=1, duration_s=-1)


def test_trace_round_trip(tmp_path):
    reqs = synthetic(rate_per_s=10, duration_s=1, seed=1)
    path = tmp_path / "t.jsonl"
    write_trace(str(path), reqs)
    back, problems = read_trace(str(path))
    assert back == reqs and problems == []


TRACE = """# a comment
{"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 2}
{"arrival_s": 0.1, "prompt_tokens": 5, "output_tokens": 1, "id": "first"}

{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 1}
not json at all
{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 1}
[1, 2]
{"arrival_s": 2, "prompt_tokens": 3, "output_tokens": 2.5}
"""


def test_malformed_lines_are_reported_by_number_and_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(TRACE)
    seen = []
    reqs, problems = read_trace(str(path), on_error=lambda n, msg: seen.append(n))
    assert reqs == [Request(id="first", arrival_s=0.1, prompt_tokens=5, output_tokens=1),
                    Request(id="line2", arrival_s=0.5, prompt_tokens=10, output_tokens=2)]
    assert [n for n, _ in problems] == seen == [5, 6, 7, 8, 9]
    assert "arrival_s" in problems[0][1] and "not JSON" in problems[1][1] and "prompt_tokens" in problems[2][1]
    assert "output_tokens" in problems[4][1]


def test_strict_trace_is_fatal_at_the_first_bad_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(TRACE)
    with pytest.raises(TraceError) as exc:
        read_trace(str(path), strict=True)
    assert exc.value.line_no == 5 and f"{path}:5" in str(exc.value)
    assert isinstance(exc.value, KvatlasError)


def test_missing_trace_file(tmp_path):
    with pytest.raises(ConfigError, match="workload"):
        read_trace(str(tmp_path / "nope.jsonl"))
