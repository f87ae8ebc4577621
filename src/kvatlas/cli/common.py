"""Deployment options shared by every command that plans a cache, and the typed argument
parsers every subcommand uses (so `--rate inf` or `--seed -1` is refused by argparse, in one line
naming the flag, before anything is planned or allocated)."""

from __future__ import annotations

import argparse
import math
import os

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
    if not os.access(folder, os.W_OK):
        raise ConfigError(flag, f"directory {folder!r} is not writable", "write somewhere else")
    if extensions is not None:
        ext = os.path.splitext(path)[1].lstrip(".").lower()
        if ext not in extensions:
            what = f"an unknown extension {ext!r}" if ext else "no extension"
            raise ConfigError(flag, f"{path!r} has {what}",
                              f"end it in one of .{', .'.join(extensions)}")


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="deepseek-v4-flash",
                   help="preset name, config.json or model directory (default: deepseek-v4-flash)")
    g = p.add_argument_group("budget")
    g.add_argument("--memory", help="KV budget per rank, e.g. 120GiB (default: --gpu × --mem-fraction − --weights)")
    g.add_argument("--gpu", default="h200", choices=sorted(GPU_MEMORY_BYTES), help="GPU whose memory is the budget (compare: also the GPU the engines run on)")
    g.add_argument("--mem-fraction", type=number(0.0, 1.0, open_low=True), default=0.9,
                   help="share of the GPU for weights + KV (default 0.9)")
    g.add_argument("--weights", default="0", help="the weights' share of one rank's memory, e.g. 40GiB (default 0)")
    g = p.add_argument_group("cache layout")
    g.add_argument("--layout", dest="kv_layout", help="v4 (fp8_ds_mla, default), bf16, uniform-fp8, unified-bf16, "
                   "unified-fp8, fp32, fp64 (a float model's rows as it computes them); V4.1: v4.1 (default), v4.1-bf16")
    g.add_argument("--indexer", help="indexer key format: fp8, fp4, bf16, fp32, fp64 (default: the layout's)")
    g.add_argument("--state-dtype", default="fp32", help="compressor state dtype: fp32, bf16 or fp64")
    g.add_argument("--online-c128", action="store_true", help="keep C128 state as running max/sum/kv")
    g.add_argument("--page-tokens", type=count(1), default=256, help="full-token page size (default 256)")
    g.add_argument("--swa-page-tokens", type=count(1), default=64, help="SWA page size (default 64)")
    g = p.add_argument_group("serving")
    g.add_argument("--max-running-requests", type=count(1), default=256)
    g.add_argument("--max-model-len", type=count(1), help="longest request in tokens (default: the model's)")
    g.add_argument("--chunked-prefill-tokens", type=count(1), default=8192)
    g.add_argument("--draft-tokens", type=count(0), default=0, help="speculative draft tokens per step")
    g.add_argument("--draft-layers", choices=("on", "off"), help="cache the MTP layers (default: on with drafts)")
    g.add_argument("--tp", type=count(1), default=1)
    g.add_argument("--pp", type=count(1), default=1)
    g.add_argument("--dp", type=count(1), default=1)
    g.add_argument("--pp-rank", type=count(0), default=0)
    g.add_argument("--prefix-checkpoints", type=count(0), default=0, help="prefix cache: resume points it may keep "
                   "(each the SWA tail and C4 state at a page boundary; default 0: no prefix cache)")


def options_from_args(args) -> dict:
    memory = parse_bytes(args.memory, "--memory") if args.memory is not None else None
    weights = parse_bytes(args.weights, "--weights") if args.weights not in ("0", 0) else 0
    return {
        "memory_bytes": memory, "gpu": args.gpu, "mem_fraction": args.mem_fraction, "weights_bytes": weights,
        "kv_layout": args.kv_layout, "indexer": args.indexer, "state_dtype": args.state_dtype,
        "online_c128": args.online_c128, "page_tokens": args.page_tokens, "swa_page_tokens": args.swa_page_tokens,
        "max_running_requests": args.max_running_requests, "max_model_len": args.max_model_len,
        "chunked_prefill_tokens": args.chunked_prefill_tokens, "draft_tokens": args.draft_tokens,
        "draft_layers": None if args.draft_layers is None else args.draft_layers == "on",
        "tp": args.tp, "pp": args.pp, "dp": args.dp, "pp_rank": args.pp_rank,
        "prefix_checkpoints": args.prefix_checkpoints,
    }


def plan_from_args(args):
    from ..planning.planner import plan
    return plan(args.model, **options_from_args(args))
