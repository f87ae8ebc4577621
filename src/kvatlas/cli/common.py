"""Deployment options shared by every command that plans a cache, and the typed argument
parsers every subcommand uses (so `--rate inf` or `--seed -1` is refused by argparse, in one line
naming the flag, before anything is planned or allocated)."""

from __future__ import annotations

import argparse
import math
import os
import re

from ..checks import MAX_COUNT, real, span, whole
from ..errors import ConfigError
from ..planning.options import GPU_MEMORY_BYTES
from ..units import parse_bytes

# What matplotlib writes without extra backends; checked before any work so a typo in --plot
# does not cost a whole run (and `kvatlas plan` need not import matplotlib to know).
PLOT_EXTENSIONS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def count(low: int = 0, high: int = MAX_COUNT):
    """An argparse type: a whole number in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_quote(text)} is not a whole number; give an integer from "
                                             f"{low:,} to {high:,}") from None
        try:
            return whole("", value, low, high)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{exc.problem}; {exc.fix}") from None
    parse.__name__ = "whole number"
    return parse


FIT = "fit"


def checkpoints_arg(text: str):
    """--prefix-checkpoints: a whole number, or 'fit' (kvatlas simulate fits it to the workload)."""
    if text.strip().lower() == FIT:
        return FIT
    try:
        return count(0)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'fit' (kvatlas simulate: fitted to the workload)") from None


checkpoints_arg.__name__ = "whole number or 'fit'"


def number(low: float = 0.0, high: float = math.inf, open_low: bool = False):
    """An argparse type: a finite number in [low, high] ((low, high] with open_low)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_quote(text)} is not a number; give a finite number "
                                             f"{span(low, high, open_low)}") from None
        try:
            return real("", value, low, high, open_low=open_low)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{exc.problem}; {exc.fix}") from None
    parse.__name__ = "number"
    return parse


_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20}


def parse_tokens(text: str, field: str) -> int:
    """A token count: 131072, 128K (×1,024) or 1M (×1,048,576)."""
    body = text.strip().lower()
    unit = body[-1:] if body[-1:] in ("k", "m") else ""
    digits = body[: len(body) - len(unit)]
    if not _ascii_digits(digits) or len(digits) > 12 or int(digits) == 0:
        raise ConfigError(field, f"{_quote(text)} is not a token count",
                          "give a whole number of tokens above 0, e.g. 131072, 128K or 1M")
    return int(digits) * _TOKEN_UNITS[unit]


def parse_mix(text: str, field: str) -> list[tuple[int | None, int]]:
    """"8x128K,32x4K" → [(8, 131072), (32, 4096)]; a part without a count ("128K") → (None, 131072)."""
    out = []
    for part in text.split(","):
        if not part.strip():
            raise ConfigError(field, f"{_quote(text)} has an empty part" if text.strip() else "is empty",
                              "write REQUESTSxCONTEXT parts joined by commas, e.g. 8x128K,32x4K, or a bare context such as 128K")
        count_text, x, ctx_text = part.strip().rpartition("x")
        if (count_text or x) and not (_ascii_digits(count_text) and 0 < int(count_text) <= MAX_COUNT):
            raise ConfigError(field, f"{_quote(part)} does not start with a request count",
                              "write REQUESTSxCONTEXT, e.g. 8x128K, or a bare context such as 128K")
        if not ctx_text.strip():
            raise ConfigError(field, f"{_quote(part)} names no context",
                              "write REQUESTSxCONTEXT, e.g. 8x128K, or a bare context such as 128K")
        out.append((int(count_text) if count_text else None, parse_tokens(ctx_text, field)))
    if not out:
        raise ConfigError(field, f"{_quote(text)} names nothing to fit", "give e.g. 8x128K or 8x128K,32x4K")
    return out


def _ascii_digits(text: str) -> bool:
    """0-9 only: str.isdigit() also takes full-width (１２８) and Arabic-Indic (٨) digits."""
    return text.isascii() and text.isdigit()


def _quote(text: str) -> str:
    r = repr(text)
    return r if len(r) <= 40 else r[:30] + "…" + r[-6:]


def check_output_file(flag: str, path: str | None, extensions=PLOT_EXTENSIONS) -> None:
    """Refuse, before any work, an output path whose directory is missing or not writable, or
    (for plots) whose extension no writer knows."""
    if path is None:
        return
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ConfigError(flag, f"{path!r} is not a file name", "give a file name such as plan.png")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(flag, f"directory {folder!r} does not exist", "create it or write somewhere else")
    if extensions is not None:
        ext = os.path.splitext(path)[1].lstrip(".").lower()
        if ext not in extensions:
            what = f"an unknown extension {ext!r}" if ext else "no extension"
            raise ConfigError(flag, f"{path!r} has {what}",
                              f"end it in one of .{', .'.join(extensions)}")
    _check_creatable(flag, path, folder)


def _check_creatable(flag: str, path: str, folder: str) -> None:
    """Create the file for a moment (or open an existing one for appending, which changes
    nothing): permission bits say yes in places that refuse every new file (/proc), so only
    trying tells, before the work rather than after it."""
    try:
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(path)
    except OSError as exc:
        raise ConfigError(flag, f"{path!r} cannot be written in {folder!r} ({exc.strerror or exc})",
                          "write somewhere else") from None


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="deepseek-v4-flash",
                   help="preset name, config.json or model directory (default: deepseek-v4-flash)")
    g = p.add_argument_group("budget (--memory, or --gpu × --mem-fraction − --weights)")
    g.add_argument("--memory", help="KV budget per rank, e.g. 120GiB; the budget itself: not with --mem-fraction "
                   "or --weights (default: --gpu × --mem-fraction − --weights)")
    g.add_argument("--gpu", choices=sorted(GPU_MEMORY_BYTES), help="GPU whose memory is the budget; with --memory, "
                   "the budget must fit it (compare: also the GPU the engines run on; default h200)")
    g.add_argument("--mem-fraction", type=number(0.0, 1.0, open_low=True),
                   help="share of the GPU for weights + KV (default 0.9)")
    g.add_argument("--weights", help="the weights' share of one rank's GPU memory, e.g. 40GiB, or auto (default "
                   "without --memory: from the config's shapes and quantization, split over --tp/--pp); not with --memory")
    g = p.add_argument_group("cache layout")
    g.add_argument("--layout", dest="kv_layout", help="v4 (fp8_ds_mla, default), bf16, uniform-fp8, unified-bf16, "
                   "unified-fp8, fp32, fp64 (a float model's rows as it computes them); V4.1: v4.1 (default), v4.1-bf16")
    g.add_argument("--indexer", help="indexer key format: fp8, fp4, bf16, fp32, fp64 (default: the layout's)")
    g.add_argument("--state-dtype", default="fp32", help="compressor state dtype: fp32, bf16 or fp64")
    g.add_argument("--online-c128", action="store_true", help="keep C128 state as running max/sum/kv")
    g.add_argument("--page-tokens", type=count(1), default=256, help="full-token page size, a multiple of 128 "
                   "(default 256)")
    g.add_argument("--swa-page-tokens", type=count(1), default=64, help="SWA page size, a multiple of 64 (default 64)")
    g = p.add_argument_group("serving")
    g.add_argument("--max-running-requests", type=count(1), default=256, action=StoreGiven,
                   help="requests running at once, all data-parallel ranks together (default 256)")
    g.add_argument("--max-model-len", type=count(1), help="longest request in tokens, at most the model's "
                   "max_position_embeddings (default: that)")
    g.add_argument("--chunked-prefill-tokens", type=count(1), default=8192,
                   help="most prompt tokens one forward pass computes (default 8192)")
    g.add_argument("--draft-tokens", type=count(0), default=0, help="speculative draft tokens per step (default 0)")
    g.add_argument("--draft-layers", choices=("on", "off"), help="cache the MTP layers (default: on with drafts)")
    g.add_argument("--tp", type=count(1), default=1, help="tensor-parallel ranks, a divisor of the attention heads "
                   "(the MLA cache is not split: every rank holds it; default 1)")
    g.add_argument("--pp", type=count(1), default=1, help="pipeline stages, at most the layers (default 1)")
    g.add_argument("--dp", type=count(1), default=1, help="data-parallel ranks sharing --max-running-requests "
                   "(default 1)")
    g.add_argument("--pp-rank", type=count(0), default=0, help="the pipeline stage to plan, 0..--pp − 1 (default 0)")
    g.add_argument("--prefix-checkpoints", type=checkpoints_arg, default=0, help="prefix cache: resume points it may "
                   "keep (each the SWA tail and C4 state at a page boundary; default 0: no prefix cache); simulate "
                   "takes 'fit': the count that hits most, found by replaying the workload at several shares of the budget")


def check_backend(backend: str, device) -> None:
    """The arena backend for the parsed --device, refused before anything is allocated: vmm maps
    CUDA memory (only tests hand it a stand-in driver on the CPU)."""
    from ..cache.arena import backend_factory
    backend_factory(backend)
    if backend == "vmm" and device.type != "cuda":
        raise ConfigError("--backend", f"vmm maps CUDA memory (it needs CUDA and cuda-python), and --device is {device}",
                          "use --device cuda on a CUDA machine, or --backend plain")


def gpu_of(args) -> str:
    return args.gpu or "h200"


def options_from_args(args, prefix_checkpoints: int | None = None) -> dict:
    """The serving options the command line gives; the budget's parts only where typed, so a
    part that would be ignored beside --memory is refused, never dropped. Without --memory the
    weights default to auto: derived from the config (planning.weights). `prefix_checkpoints`, if
    given, replaces --prefix-checkpoints (simulate's fit plans before it has a count)."""
    out = {
        "kv_layout": args.kv_layout, "indexer": args.indexer, "state_dtype": args.state_dtype,
        "online_c128": args.online_c128, "page_tokens": args.page_tokens, "swa_page_tokens": args.swa_page_tokens,
        "max_running_requests": args.max_running_requests, "max_model_len": args.max_model_len,
        "chunked_prefill_tokens": args.chunked_prefill_tokens, "draft_tokens": args.draft_tokens,
        "draft_layers": None if args.draft_layers is None else args.draft_layers == "on",
        "tp": args.tp, "pp": args.pp, "dp": args.dp, "pp_rank": args.pp_rank,
        "prefix_checkpoints": _checkpoints(args.prefix_checkpoints) if prefix_checkpoints is None else prefix_checkpoints,
        "memory_bytes": parse_bytes(args.memory, "--memory") if args.memory is not None else None,
    }
    if args.weights is not None:
        out["weights_bytes"] = weights_arg(args.weights)
    elif args.memory is None:
        out["weights_bytes"] = "auto"
    for key, value in (("gpu", args.gpu), ("mem_fraction", args.mem_fraction)):
        if value is not None:
            out[key] = value
    return out


def _checkpoints(value):
    if value == FIT:   # simulate replaces it with the fitted count before it plans
        raise ConfigError("--prefix-checkpoints", "'fit' replays a workload, and only `kvatlas simulate` replays one",
                          "run kvatlas simulate with the workload and --prefix-checkpoints fit, then give the count "
                          "it prints")
    return value


class StoreGiven(argparse.Action):
    """A plain store that also notes, in the namespace's `given` set, that the flag was on the
    command line (its default cannot tell: a flag that another one fits must not be given too)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def given(args, dest: str) -> bool:
    """Whether the StoreGiven flag `dest` was on the command line."""
    return dest in getattr(args, "given", ())


def counts_arg(text: str) -> list[int]:
    """--fit-running: a comma list of running-request counts, each a whole number from 1."""
    parse = count(1, 1 << 20)
    parts = [x.strip() for x in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("no count given; give a comma list such as 64,128,256")
    return sorted({parse(x) for x in parts})


counts_arg.__name__ = "comma list of counts"


def add_fit_running_args(p, fit_flag: str) -> None:
    """--fit-running and --fit-ttft-slack (kvatlas.driving.fit), given beside `fit_flag`."""
    p.add_argument("--fit-running", type=counts_arg, default=None, metavar="N,N,...",
                   help=f"with {fit_flag}: also fit --max-running-requests among these counts (each slot's fixed "
                        "state comes out of the budget): the count that hits most among those whose mean time to "
                        "first token is within --fit-ttft-slack of the lowest, its share fitted as for one count")
    p.add_argument("--fit-ttft-slack", type=number(0.0, 1e6), default=None, metavar="F",
                   help="with --fit-running: how much more mean TTFT than the lowest a count may cost, as a fraction "
                        "(default 0.1: 10%%)")


def check_fit_running_args(args, fitting: bool, fit_flag: str) -> float:
    """The two flags' checks (`fitting`: `fit_flag` was given); returns the slack to fit with."""
    if args.fit_ttft_slack is not None and args.fit_running is None:
        raise ConfigError("--fit-ttft-slack", "weighs the running counts --fit-running tries", "give it with "
                          "--fit-running, or drop it")
    if args.fit_running is not None and not fitting:
        raise ConfigError("--fit-running", "fits the running count beside the resume points", f"give it with "
                          f"{fit_flag}, or give --max-running-requests alone")
    if args.fit_running is not None and given(args, "max_running_requests"):
        raise ConfigError("--max-running-requests", f"{args.max_running_requests} is the count --fit-running "
                          "chooses among " + ",".join(map(str, args.fit_running)),
                          "drop --max-running-requests to fit it, or drop --fit-running to run with it")
    from ..driving.fit import TTFT_SLACK
    return TTFT_SLACK if args.fit_ttft_slack is None else args.fit_ttft_slack


def weights_arg(text: str):
    """--weights as plan() takes it: "auto", 0 (none: the whole fraction is KV) or bytes."""
    w = text.strip()
    return "auto" if w == "auto" else 0 if w in ("0", "0B") else parse_bytes(text, "--weights")


def plan_from_args(args):
    from ..planning.planner import plan
    return plan(args.model, **options_from_args(args))


# Python argument names as the command line spells them: errors raised below the CLI name the
# Python argument (kvatlas.plan(max_model_len=...)); the CLI says the flag the user typed.
FLAGS = {
    "memory_bytes": "--memory", "weights_bytes": "--weights", "mem_fraction": "--mem-fraction", "gpu": "--gpu",
    "kv_layout": "--layout", "indexer": "--indexer", "state_dtype": "--state-dtype", "online_c128": "--online-c128",
    "page_tokens": "--page-tokens", "swa_page_tokens": "--swa-page-tokens",
    "max_running_requests": "--max-running-requests", "max_model_len": "--max-model-len",
    "chunked_prefill_tokens": "--chunked-prefill-tokens", "draft_tokens": "--draft-tokens",
    "draft_layers": "--draft-layers", "tp": "--tp", "pp": "--pp", "dp": "--dp", "pp_rank": "--pp-rank",
    "prefix_checkpoints": "--prefix-checkpoints", "host_memory_bytes": "--host-memory",
    "checkpoint_share": "--host-checkpoint-share", "backend": "--backend", "device": "--device",
    "trace_format": "--trace-format", "prompt_len": "--prompt-len", "output_len": "--output-len",
    "followup_len": "--followup-len", "system_prompt_len": "--system-prompt-len", "think_s": "--think",
    "system_prompts": "--system-prompts", "turns": "--turns", "rate": "--rate", "duration": "--duration",
    "seed": "--seed", "workload": "--workload", "host": "--host", "port": "--port",
    "namespace": "--shared-namespace", "policy": "--shared-policy",
    # compare's engine options (kvatlas.engines.compare(engine_options=...))
    "engine": "--engines", "engines": "--engines", "swa_ratio": "--sglang-swa-ratio", "prefix_tails": "--sglang-prefix-tails",
    "platform": "--sglang-platform", "max_num_batched_tokens": "--vllm-max-num-batched-tokens",
    "entrypoint": "--vllm-entrypoint",
}
# names that are also plain words ("the backend", "a device") are flags only as `name=` or `name:`
_WORDS = {"engine", "engines", "namespace", "policy", "platform", "entrypoint", "indexer", "backend", "device", "rate", "duration", "seed", "workload", "turns", "host", "port"}
_NAME = re.compile(r"(?P<quoted>(?<![\w=])'[^'\n]*'|(?<![\w=])\"[^\"\n]*\")"   # a value the user gave, quoted
                   r"|(?<![\w.\-])(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")(?![\w\-])"
                   r"(=(['\"]?)([^\s'\",;)]*)\4|:)?")


def cli_terms(message: str) -> str:
    """`message` with Python argument names as the flags: "max_model_len=4096" becomes
    "--max-model-len 4096", "backend='plain'" "--backend plain", "kv_layout:" "--layout:". A quoted value ('tp') is the user's own word
    and stays as typed."""
    def swap(m: re.Match) -> str:
        if m.group("quoted"):   # the user's own value (repr-quoted): never rewritten
            return m.group(0)
        name, tail = m.group(2), m.group(3) or ""
        if name in _WORDS and not tail:
            return m.group(0)
        if tail.startswith("="):
            return f"{FLAGS[name]} {m.group(5)}".rstrip()
        return FLAGS[name] + tail
    return _NAME.sub(swap, message)
