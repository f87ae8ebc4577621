"""Deployment options shared by every command that plans a cache."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ..planning.options import GPU_MEMORY_BYTES
from ..units import parse_bytes


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="deepseek-v4-flash",
                   help="preset name, config.json or model directory (default: deepseek-v4-flash)")
    g = p.add_argument_group("budget")
    g.add_argument("--memory", help="KV budget per rank, e.g. 120GiB (default: --gpu × --mem-fraction − --weights)")
    g.add_argument("--gpu", default="h200", choices=sorted(GPU_MEMORY_BYTES), help="GPU whose memory is the budget")
    g.add_argument("--mem-fraction", type=float, default=0.9, help="share of the GPU for weights + KV (default 0.9)")
    g.add_argument("--weights", default="0", help="the weights' share of one rank's memory, e.g. 40GiB (default 0)")
    g = p.add_argument_group("cache layout")
    g.add_argument("--layout", dest="kv_layout", help="v4 (fp8_ds_mla, default), bf16, uniform-fp8, unified-bf16, "
                   "unified-fp8; V4.1: v4.1 (default), v4.1-bf16")
    g.add_argument("--indexer", help="indexer key format: fp8, fp4, bf16 (default: the layout's)")
    g.add_argument("--state-dtype", default="fp32", help="compressor state dtype: fp32 or bf16")
    g.add_argument("--online-c128", action="store_true", help="keep C128 state as running max/sum/kv")
    g.add_argument("--page-tokens", type=int, default=256, help="full-token page size (default 256)")
    g.add_argument("--swa-page-tokens", type=int, default=64, help="SWA page size (default 64)")
    g = p.add_argument_group("serving")
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--max-model-len", type=int, help="longest request in tokens (default: the model's)")
    g.add_argument("--chunked-prefill-tokens", type=int, default=8192)
    g.add_argument("--draft-tokens", type=int, default=0, help="speculative draft tokens per step")
    g.add_argument("--draft-layers", choices=("on", "off"), help="cache the MTP layers (default: on with drafts)")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--dp", type=int, default=1)
    g.add_argument("--pp-rank", type=int, default=0)
    g.add_argument("--prefix-checkpoints", type=int, default=0, help="prefix cache: resume points it may keep "
                   "(each the SWA tail and C4 state at a page boundary; default 0: no prefix cache)")


def options_from_args(args) -> dict:
    memory = parse_bytes(args.memory, "--memory") if args.memory is not None else None
    try:
        weights = parse_bytes(args.weights, "--weights") if args.weights not in ("0", 0) else 0
    except ConfigError:
        raise
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
