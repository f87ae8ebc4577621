"""Bad input on the command line, in config files and in traces: every case is refused with exit
status 2 and ONE line on stderr naming the field, no traceback, and nothing allocated first.

Table-driven and in-process (`kvatlas.cli.main`), so hundreds of cases run in a few seconds; a
few cases go through a real subprocess as well (the exit status the shell sees, a closed pipe,
a missing torch). The Python API's table is tests/test_bad_input_api.py.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from kvatlas.cli import main
from kvatlas.cli.common import FLAGS
from kvatlas.planning.model import PRESET_DIR

BIG = "1" + "0" * 400
TINY = ["tiny-v4", "--memory", "64MiB", "--max-running-requests", "4"]

# flag → [(bad value, what the one-line message must name)]; None: the flag itself
DEPLOYMENT = {
    "--memory": ["abc", "-1GiB", "0", BIG, "nan", "inf", "1.5XB", "", ("1KiB", "memory"), "12 GiB GiB", "0x10",
                 "1" + "0" * 30 + ".5"],
    "--weights": ["abc", "-5", BIG, "nan", "1.5.5GiB"],
    "--mem-fraction": ["0", "1.5", "nan", "inf", "-0.1", "x", ""],
    "--max-running-requests": ["-3", "0", "1.5", "x", "1e3", "99999999999", "", "nan", BIG],
    "--max-model-len": ["0", "-1", "2.5", "x", "inf", BIG],
    "--chunked-prefill-tokens": ["0", "-8", "x", "1e4"],
    "--draft-tokens": ["-1", "x", "0.5", BIG],
    "--page-tokens": ["0", "x", "100", "64"],
    "--swa-page-tokens": ["0", "x", "32", "100"],
    "--tp": ["0", "-1", "x"],
    "--pp": ["0", "x", "1.0"],
    "--dp": ["0", "-2", "x"],
    "--pp-rank": ["-1", "x", "3"],
    "--gpu": ["a100", ""],
    "--layout": ["fp16", "", "v4.1"],
    "--indexer": ["fp2", ""],
    "--state-dtype": ["fp16", ""],
    "--draft-layers": ["maybe", "1", ""],
}
WORKLOAD = {
    "--rate": ["inf", "nan", "0", "-1", "x", "1e7"],
    "--duration": ["inf", "nan", "0", "-5", "x", "1e8"],
    "--seed": ["-1", "1.5", "x", BIG],
    "--prompt-len": ["nan", "inf", "1e30", "0", "x", "uniform:5:1", "uniform:1", "exp:-3", "lognormal:10:99",
                     "weibull:3", "uniform:1:1e30", ""],
    "--output-len": ["nan", "-1", "exp:inf", "x:y"],
    "--accept-rate": ["1.5", "-0.1", "nan", "x"],
    "--step-ms": ["0", "-1", "nan", "inf", "x"],
    "--write-layers": ["-1", "x", "1.5", BIG],
    "--device": [("tpu", "device"), ("cuda:x", "device"), ("", "device")],
    "--backend": [("mmap", "backend")],
    "--turns": [("0", "turns"), ("nan", "turns"), ("x", "turns"), ("1e12", "turns")],
    "--system-prompts": ["-1", "x", "1e9", "1.5"],
    "--think": [("-1", "think"), ("exp:inf", "think"), ("x", "think")],
    "--trace-format": ["csv", ""],
    "--prefill-us-per-token": ["-1", "nan", "inf", "x"],
    "--decode-us-per-token": ["-1", "nan", "x"],
    "--sample-ms": ["-1", "nan", "inf"],
}
ALLOC = {"--device": [("tpu", "device"), ("cuda:x", "device"), ("", "device")], "--backend": [("mmap", "backend"), ("", "backend")]}
SERVE = {
    "--host": [(h, "host") for h in ("", " ", "10.0.0.1", "::", "example.com", "0.0.0.0.0", "192.168.1.1")],
    "--port": ["-1", "65536", "x", "1.5"],
    "--linger": ["nan", "inf", "-2", "-0.5", "x"],
    "--progress-s": ["0", "nan", "-1", "inf"],
}
COMPARE = {
    "--engines": ["", ",", " , ", ("trt", "engine"), ("sglang:fast", "sglang")],
    "--sglang-swa-ratio": ["0", "1.5", "nan", "x"],
    "--sglang-prefix-tails": ["-1", "x"],
    "--vllm-max-num-batched-tokens": ["0", "x"],
    "--sglang-platform": ["rocm"],
}


def _cases(cmds, table, extra=()):
    out = []
    for cmd in cmds:
        for flag, values in table.items():
            for v in values:
                value, needle = v if isinstance(v, tuple) else (v, flag)
                out.append(pytest.param([cmd, *TINY, *extra, flag, value], needle,
                                        id=f"{cmd}{flag}={value[:12]!r}-{needle if isinstance(needle, str) else 'x'}"))
    return out


OUTPUTS = [
    (["plan", *TINY, "--plot", "/nonexistent-dir/p.png"], "--plot"),
    (["plan", *TINY, "--plot", "plan.bmpx"], "--plot"),
    (["plan", *TINY, "--plot", "plan"], "--plot"),
    (["plan", *TINY, "--plot", ""], "--plot"),
    (["plan", *TINY, "--plot", "."], "--plot"),
    (["compare", *TINY, "--plot", "/nonexistent-dir/c.png"], "--plot"),
    (["compare", *TINY, "--plot", "c.txt"], "--plot"),
    (["simulate", *TINY, "--out", "/nonexistent-dir/run"], "--out"),
    (["simulate", *TINY, "--out", ""], "--out"),
    (["simulate", *TINY, "--out", "."], "--out"),
    (["simulate", *TINY, "--max-steps", "0"], "--max-steps"),
    (["simulate", *TINY, "--max-steps", "x"], "--max-steps"),
]
MISC = [
    (["plan", "deepseek-v9"], "model"),
    (["plan", ""], "model"),
    (["plan", "no/such/config.json"], "model"),
    (["plan", "--frobnicate"], "--frobnicate"),
    (["plan", "a", "b"], "b"),
    (["models", "--json", "x"], "x"),
    (["models", "--all"], "--all"),
    (["frobnicate"], "frobnicate"),
    (["--memory", "1GiB"], "COMMAND"),
    (["simulate", *TINY, "--rate", "1e6", "--duration", "100"], "rate"),
    (["serve", *TINY, "--rate", "1000", "--duration", "1e5"], "rate"),
    (["simulate", *TINY, "--backend", "none", "--write-layers", "1"], "--write-layers"),
    (["simulate", *TINY, "--turns", "uniform:1:100000", "--rate", "1000", "--duration", "100"], "turns"),
    (["plan", *TINY, "--online-c128", "--state-dtype", "bf16"], "--online-c128"),
    (["plan", "tiny-v4", "--weights", "200GiB"], "--weights"),
    (["plan", "deepseek-v4-flash", "--memory", "1GiB"], "--memory"),
    (["compare", *TINY, "--sglang-no-radix", "--engines", "vllm"], "sglang"),
    (["simulate", *TINY, "--workload", "no-such-trace.jsonl"], "workload"),
    (["serve", *TINY, "--workload", "no-such-trace.jsonl"], "workload"),
    # the host tier: it needs the prefix cache, and each value is checked before allocation
    (["simulate", *TINY, "--host-memory", "1GiB"], "--prefix-checkpoints"),
    (["serve", *TINY, "--host-memory", "1GiB"], "--host-memory"),
    *[(["simulate", *TINY, "--prefix-checkpoints", "4", "--host-memory", v], "--host-memory")
      for v in ("x", "-1GiB", "0", "1B", "nan", "")],
    *[(["simulate", *TINY, "--prefix-checkpoints", "4", "--host-memory", "64MiB", "--host-checkpoint-share", v],
       "--host-checkpoint-share") for v in ("1", "-0.1", "nan", "x")],
    (["simulate", *TINY, "--prefix-checkpoints", "4", "--host-checkpoint-share", "0.5"], "--host-checkpoint-share"),
]

# Round two: deployments that cannot exist, and budgets too small because of one option, whose
# refusal must name that option (TINY: 6 layers, 4 heads, 4 running requests, context 4,096)
IMPOSSIBLE = {
    "--pp": ["7", "100"],
    "--tp": ["3", "8", "1024"],
    "--dp": ["5", "100000"],
    "--max-model-len": ["4097", "100000"],
    "--weights": [("40GiB", ("--weights", "--memory")), ("1B", ("--weights", "--memory"))],
    "--mem-fraction": [("0.5", ("--mem-fraction", "--memory"))],
    "--draft-tokens": ["100000"],
    "--chunked-prefill-tokens": ["2000000000"],
    "--prefix-checkpoints": ["100000"],
    "--swa-page-tokens": ["4096"],
    "--page-tokens": ["1048576"],
    "--max-running-requests": ["1000"],
}
HOST = ["--prefix-checkpoints", "4", "--host-memory"]
ROUND_TWO = [
    (["plan", "tiny-v4", "--gpu", "h100", "--memory", "200GiB"], ("--memory", "h100")),
    (["compare", "--gpu", "h20", "--memory", "120GiB"], ("--memory", "h20")),
    (["plan", "--weights", "40GiB", "--memory", "100GiB"], ("--weights", "--memory", "--gpu")),
    (["plan", "--memory", "120GiB", "--draft-tokens", "100000"],
     ("--draft-tokens 100000 makes it too big", "lower --draft-tokens to")),
    (["plan", "--memory", "120GiB", "--draft-tokens", "100000", "--chunked-prefill-tokens", "2000000000"],
     ("--draft-tokens", "together")),
    (["plan", "--memory", "1GiB"], ("lower --max-running-requests to 1 and --max-model-len to", "--memory")),
    (["alloc", *TINY, "--backend", "vmm"], ("--backend", "--device cuda")),
    (["simulate", *TINY, *HOST, "4TiB"], ("--host-memory", "available")),
    (["serve", *TINY, *HOST, "4TiB"], ("--host-memory", "available")),
    (["simulate", *TINY, "--backend", "none", *HOST, "1024TiB"], ("--host-memory", "bookkeeping")),
    (["serve", *TINY, "--backend", "none", *HOST, "1024TiB"], ("--host-memory", "bookkeeping")),
    *[([cmd, *TINY, "--workload", dev], ("--workload", "not a regular file or a pipe"))
      for cmd in ("simulate", "serve") for dev in ("/dev/zero", "/dev/null", "/dev/urandom")],
    *[([cmd, *TINY, "--turns", t, *extra], ("--turns", "at most"))
      for cmd in ("simulate", "serve")
      for t, extra in (("100001", []), ("uniform:1:200000", []), ("1e6", []), ("exp:300000", ["--rate", "20"]),
                       ("100000", ["--rate", "100", "--duration", "1"]))],
    *[([cmd, *TINY, "--plot", path], "--plot") for cmd in ("plan", "compare") for path in ("/proc/x.png", "/sys/x.png")],
    (["simulate", *TINY, "--out", "/proc/run"], "--out"),
    (["serve", *TINY, "--host", "::2"], "--host"),
    (["serve", *TINY, "--host", "fe80::1"], "--host"),
    *[(["audit", "--sglang", "--memory", "1GiB", flag, v], flag)
      for flag, v in (("--max-running-requests", "-5"), ("--max-running-requests", "0"),
                      ("--chunked-prefill-tokens", "0"), ("--chunked-prefill-tokens", "x"), ("--context-length", "-1"))],
]

# the shared tier's URL, checked whole without connecting (issue 38); with a host tier under a prefix cache
SHARED = {
    "--shared-tier": ["redis://[::1", "redis://127.0.0.1:0", "redis://127.0.0.1:65536", "redis://127.0.0.1",
                      "redis://127.0.0.1:6379/-1", "redis://127.0.0.1:6379/x", "redis://127.0.0.1:6379/99999999999",
                      *[f"redis://127.0.0.1:6379?timeout={t}" for t in ("nan", "-1", "inf", "0", "x")],
                      "redis://127.0.0.1:6379?timeout=1&timeout=2", "redis://127.0.0.1:6379?ca=x.pem",
                      "rediss://127.0.0.1:6379?ca=/nonexistent/ca.pem", "redis://user@127.0.0.1:6379",
                      "redis://:pa#ss@127.0.0.1:6379", "redis:// 127.0.0.1:6379", "gopher://127.0.0.1:70", "",
                      "mooncake://127.0.0.1:50051", "mooncake://127.0.0.1:50051?metadata=nope",
                      "mooncake://u:p@127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata",
                      "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:1/metadata&segment=abc",
                      "memory://x?capacity=abc", "memory://u:p@x"],
    "--shared-startup-s": ["0", "-1", "nan", "inf", "601", "x"],
}
SHARED_HOST = ["--prefix-checkpoints", "4", "--host-memory", "8MiB"]

CLI_CASES = (_cases(["plan", "compare", "alloc", "serve", "simulate"], DEPLOYMENT)
             + _cases(["serve", "simulate"], SHARED, SHARED_HOST)
             + _cases(["serve", "simulate"], WORKLOAD)
             + _cases(["alloc"], ALLOC)
             + _cases(["serve"], SERVE)
             + _cases(["compare"], COMPARE)
             + _cases(["plan", "compare", "alloc", "serve", "simulate"], IMPOSSIBLE)
             + [pytest.param(a, n, id=" ".join(a)[:60]) for a, n in OUTPUTS + MISC + ROUND_TWO])


class Allocated(Exception):
    """Raised if a refused command gets as far as allocating: bad input must be refused first."""


@pytest.fixture
def no_allocation(monkeypatch, tmp_path):
    """Every case runs in a scratch directory with allocation forbidden (an attempt is a bug:
    exit 1, so the exit-status assertion catches it)."""
    from kvatlas.cache import arena

    def refuse(*a, **k):
        raise Allocated("allocation reached")
    monkeypatch.setattr(arena.Arena, "__init__", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_refused(capsys, argv, needle):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}: {err}"
    assert "Traceback" not in err
    line = err.strip()
    assert line and "\n" not in line, f"not one line: {err!r}"
    for n in (needle if isinstance(needle, tuple) else (needle,)):
        assert n in line, f"{n!r} not named in: {line}"
    assert line.startswith("kvatlas") and "='" not in line   # flags, not Python keywords (backend='plain')
    python = PYTHON_NAMES.search(line)
    assert python is None, f"the CLI names the Python argument {python.group(0)!r}: {line}"


# Python argument names (those with an underscore: unambiguous in prose); a config field
# (config.sliding_window) is the user's own term and stays
PYTHON_NAMES = re.compile(r"(?<![\w.\-])(" + "|".join(n for n in FLAGS if "_" in n) + r")(?![\w\-])")


@pytest.mark.parametrize("argv,needle", CLI_CASES)
def test_bad_command_line(no_allocation, capsys, argv, needle):
    assert_refused(capsys, argv, needle)


# ------------------------------------------------------------------ config files and directories
def _tiny():
    with open(os.path.join(PRESET_DIR, "tiny-v4.json")) as f:
        return json.load(f)


# key → bad values (each replaces the preset's value); None deletes the key
CONFIG = {
    "index_head_dim": [-1, 1.5, "128", 0, True, 2**40, [128]],
    "index_n_heads": [-4, 2.5, "4", False],
    "index_topk": [-1, 0.5, "x"],
    "num_nextn_predict_layers": [-1, "1", 1.0],
    "max_position_embeddings": [0, -1, 1.5, "4096", None, 2**40, True],
    "head_dim": [0, -512, 512.0, "512", None, 32],
    "qk_rope_head_dim": [-1, 512, 600, "64", None],
    "sliding_window": [0, -128, 128.5, None],
    "hidden_size": [0, -1, "x", None],
    "num_attention_heads": [0, -4, 4.0],
    "num_hidden_layers": [0, -6, 6.5, (99, "compress_ratios"), None, True],
    "compress_ratios": [[0, 4], "0,4", [0, 4, 128, 4, 128, 0, 4], [0, 8, 128, 4, 128, 0, 0], None,
                        [0, 4, 128, 4, 128, 0, 0.5], [True] * 7, 12],
}


def _config_cases():
    out = []
    for key, values in CONFIG.items():
        for v in values:
            cfg = _tiny()
            v, needle = v if isinstance(v, tuple) else (v, key)
            if v is None:
                cfg.pop(key)
                v = "<missing>"
            else:
                cfg[key] = v
            out.append(pytest.param(json.dumps(cfg), needle, id=f"{key}={str(v)[:12]}"))
    return out


RAW_CONFIGS = [
    ("[1, 2, 3]", "config"), ("", "model"), ("{", "model"), ("\xff\xfe{}", "model"), ("[" * 100000, "model"),
    ('{"text_config": {"num_hidden_layers": 2}}', "compress_ratios"), ("null", "config"), ("42", "config"),
    ('{"compress_ratios": [0, 1, 2], "num_hidden_layers": 3}', "kv_source_layer_ids"),
    ('{"num_hidden_layers": 3}', "compress_ratios"), ("NaN", "config"),
]


@pytest.mark.parametrize("text,needle", _config_cases() + [pytest.param(t, n, id=f"raw:{t[:10]!r}")
                                                           for t, n in RAW_CONFIGS])
def test_bad_config_file(no_allocation, capsys, text, needle):
    from kvatlas import ConfigError, load_model
    path = no_allocation / "config.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if "\xff" not in text else b"\xff\xfe{}")
    with pytest.raises(ConfigError) as exc:
        load_model(str(path))
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert_refused(capsys, ["plan", str(path), "--memory", "1GiB"], needle)
    assert_refused(capsys, ["plan", str(no_allocation), "--memory", "1GiB"], needle)   # the directory form


def test_config_directory_without_config_json(no_allocation, capsys):
    (no_allocation / "model").mkdir()
    assert_refused(capsys, ["plan", str(no_allocation / "model")], "model")


# a config the loader takes, but no deployment of it can exist: refused when planned
PLANNED_CONFIGS = [
    ({"head_dim": 256}, "config.head_dim: 256 is not supported"),
    ({"head_dim": 1024}, "config.head_dim"),
    ({"qk_rope_head_dim": 32}, "config.qk_rope_head_dim"),
    ({"index_head_dim": 64}, "config.index_head_dim"),
    ({"index_head_dim": 256}, "config.index_head_dim"),
    ({"sliding_window": 8192}, ("config.sliding_window=8192", "makes it too big")),
    ({"max_position_embeddings": 2048}, ("--max-model-len", "max_position_embeddings 2,048")),
    ({"num_attention_heads": 3, "o_groups": 1}, ("--tp", "3 attention heads")),   # (o_groups 1 divides 3)
    ({"num_hidden_layers": 2, "compress_ratios": [0, 4, 0]}, ("--pp", "2 layers")),
]


@pytest.mark.parametrize("change,needle", PLANNED_CONFIGS, ids=[str(c)[:30] for c, _ in PLANNED_CONFIGS])
def test_config_no_deployment_of_which_can_exist(no_allocation, capsys, change, needle):
    path = no_allocation / "config.json"
    path.write_text(json.dumps({**_tiny(), **change}))
    extra = {"num_attention_heads": ["--tp", "2"], "num_hidden_layers": ["--pp", "3"],
             "max_position_embeddings": ["--max-model-len", "4096"]}.get(next(iter(change)), [])
    assert_refused(capsys, ["plan", str(path), "--memory", "64MiB", "--max-running-requests", "8", *extra], needle)
    from kvatlas import KvatlasError, plan
    kw = {"--tp": "tp", "--pp": "pp", "--max-model-len": "max_model_len"}
    with pytest.raises(KvatlasError) as exc:
        plan(str(path), "64MiB", max_running_requests=8, **({kw[extra[0]]: int(extra[1])} if extra else {}))
    for n in (needle if isinstance(needle, tuple) else (needle,)):
        assert n.replace("--max-model-len", "max_model_len").replace("--tp", "tp").replace("--pp", "pp") in str(exc.value)


def test_config_files_the_loader_misnamed(no_allocation, capsys):
    big = no_allocation / "big" / "config.json"
    big.parent.mkdir()
    big.write_text(json.dumps({**_tiny(), "pad": "x" * (17 * 2**20)}))   # valid JSON, past the read cap
    assert_refused(capsys, ["plan", str(big.parent)], ("model", "more than the 16 MiB"))
    many = no_allocation / "many.json"
    many.write_text(json.dumps({**_tiny(), "num_hidden_layers": 5000, "compress_ratios": [4] * 5000}))
    assert_refused(capsys, ["plan", str(many)], "config.compress_ratios: has 5,000 entries")
    bom = no_allocation / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(_tiny()).encode())   # saved with a byte-order mark: read
    assert main(["plan", str(bom), "--memory", "64MiB", "--max-running-requests", "4"]) == 0


# ------------------------------------------------------------------ trace lines (the existing reader)
TRACE_LINES = [
    "not json", "[1, 2]", '"text"', "{}", '{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": Infinity, "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": "0", "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": true, "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": 1.5, "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": "5", "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": 5}', '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": -5}',
    '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": null}',
    '{"prompt_tokens": 5, "output_tokens": 5}',
    # the streaming reader's own cases: a repeated id, an overlong line, Mooncake lines
    '{"id": "line1", "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5}',
    '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "pad": "' + "x" * (1 << 20) + '"}',
    '{"timestamp": -5, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
    '{"timestamp": 5, "input_length": 1000, "output_length": 5, "hash_ids": [1]}',
    '{"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [1]}',
    '{"timestamp": 5, "input_length": 10, "output_length": 5, "hash_ids": ["a"]}',
    '{"timestamp": NaN, "input_length": 10, "output_length": 5, "hash_ids": [1]}',
]


@pytest.mark.parametrize("line", TRACE_LINES, ids=[t[:40] for t in TRACE_LINES])
@pytest.mark.parametrize("cmd", ["simulate", "serve"])
def test_bad_trace_line_with_strict_trace(no_allocation, capsys, cmd, line):
    path = no_allocation / "t.jsonl"
    path.write_text('{"id": "line1", "arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n' + line + "\n")
    assert_refused(capsys, [cmd, *TINY, "--workload", str(path), "--strict-trace"], f"{path}:2")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", b"\x80" * 100])
def test_trace_that_is_not_text(no_allocation, capsys, content):
    path = no_allocation / "t.jsonl"
    path.write_bytes(content)
    assert_refused(capsys, ["simulate", *TINY, "--workload", str(path)], "workload")


def test_trace_that_is_a_directory(no_allocation, capsys):
    assert_refused(capsys, ["simulate", *TINY, "--workload", str(no_allocation)], "workload")


# ------------------------------------------------------------------ what the shell sees
def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvatlas", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("args,needle", [(["plan", "--memory", BIG], "--memory"),
                                         (["compare", "--engines", ""], "--engines"),
                                         (["serve", "tiny-v4", "--host", ""], "host")])
def test_exit_status_through_a_real_process(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_torch_is_one_line_naming_the_fix(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for args in (["alloc", *TINY], ["simulate", *TINY, "--duration", "0.1", "--out", str(tmp_path / "s")]):
        r = run_cli(*args, env=env)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "torch" in r.stderr and "pip install torch==2.13.0" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import kvatlas; kvatlas.allocate(kvatlas.plan('tiny-v4', '64MiB', "
                        "max_running_requests=4))"], capture_output=True, text=True, env=env, timeout=60)
    assert "MissingDependencyError: torch: not installed" in r.stderr and "pip install torch==2.13.0" in r.stderr


@pytest.mark.parametrize("how", ["/dev/full", "closed"])
def test_stdout_that_cannot_be_written_is_one_line(how):
    if how == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open(os.devnull if how == "closed" else how, "w") as out:
        r = subprocess.run([sys.executable, "-m", "kvatlas", "plan", "--tp", "4", "--json"], stdout=out, stderr=subprocess.PIPE,
                           text=True, timeout=120, preexec_fn=(lambda: os.close(1)) if how == "closed" else None)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvatlas plan: error: stdout: ") and "Traceback" not in r.stderr


def test_broken_pipe_is_quiet():
    proc = subprocess.Popen([sys.executable, "-m", "kvatlas", "compare", "--tp", "4", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()   # the reader is gone before the first write: `| head -0`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_unexpected_error_is_one_line_naming_the_bug(monkeypatch, capsys, tmp_path):
    """The innermost frame is not kvatlas's although its path holds /kvatlas/ (a checkout is often
    named so): the locator names the package's own file, found by its real location."""
    from kvatlas.cli import plan as plan_cli

    ns = {}
    fake = tmp_path / "kvatlas" / "tests" / "helper.py"
    exec(compile("def boom(p, **_):\n    raise ZeroDivisionError('division by zero')\n", str(fake), "exec"), ns)
    boom = ns["boom"]
    monkeypatch.setattr(plan_cli, "text_report", boom)
    assert main(["plan", *TINY]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error: ZeroDivisionError" in err and "kvatlas/cli/plan.py" in err and "report it" in err
    assert main(["plan", *TINY, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err and err.strip().splitlines()[-1].startswith("kvatlas plan: internal")


def test_help_and_version_exit_zero(capsys):
    assert main(["plan", "--help"]) == 0 and main(["--version"]) == 0 and main([]) == 0
    assert "usage" in capsys.readouterr().out


# ------------------------------------------------------------------ a shared tier that answers and refuses
@pytest.mark.parametrize("cmd", ["simulate", "serve"])
def test_shared_tier_on_a_port_that_is_not_redis(no_allocation, capsys, cmd):
    """An HTTP server on the port named by redis://: refused at start-up (PING), exit 2, one
    line naming the flag and saying what answered; nothing allocated (the store is opened first)."""
    import threading

    import test_shared_startup
    test_shared_startup.client("redis")
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        argv = [cmd, *TINY, *SHARED_HOST, "--shared-tier", f"redis://127.0.0.1:{httpd.server_address[1]}"]
        rc = main(argv + (["--port", "0"] if cmd == "serve" else []))
    finally:
        httpd.shutdown()
        httpd.server_close()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "Traceback" not in "\n".join(err), err
    line = err[-1]   # (serve: after its one "starting" notice, which comes before the store is opened)
    assert line.startswith(f"kvatlas {cmd}: error: --shared-tier: redis 127.0.0.1:") and "is not Redis" in line, line
    assert len(err) == (2 if cmd == "serve" else 1), err
