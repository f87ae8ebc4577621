"""A decode step of transformers' DeepSeek-V4 through kvatlas against through the model's own cache,
on one GPU, at 8K / 64K / 256K tokens of context, in one run.

The model: V4-Flash's attention shapes (hidden 4096, 64 heads of 512, q rank 1024, 8 output groups
of 1024, indexer 64 x 128 with top-512, window 128, ratios 4 and 128, its rope) and a few layers
([CSA, HCA, CSA, HCA] by default), bf16 with the float32 modules of a released checkpoint, random
weights (the position bias, sinks and hash table drawn too). Fewer routed experts than V4-Flash's
256 (`--experts`): the attention and the cache are what is compared.

Both caches are brought to each context by the calls the model makes on them, in 8,192-token
passes with random rows (per layer: update, store_compression_weights, update_overlap_state,
update_compressor_states): a prefill through the model's eager attention at 256K would take more
memory than the card has. Then decode steps through the model, one token each; the step time is
host time around the whole forward pass (the model is launch-bound: synchronising first and last,
everything the adapter does in Python included), the caches taking turns step by step so that the
host's drift hits them alike; medians (and the median of each step's ratio to the own cache's step
of the same turn).

    python bench/transformers_decode_gpu.py [--contexts 8192,65536,262144] [--layouts fp8,exact[,own2]]
        [--steps 30] [--rounds 6] [--warmup 16] [--experts 16] [--layers csa,hca,csa,hca] [--json OUT.json]
    (--device cpu --vocab 512 --experts 8 --contexts 1024,2048: a dry run of the script on a CPU;
    the layout own2 is a second own cache, a control: what each figure reads for equal work)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CHUNK = 8192
KINDS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention", "swa": "sliding_attention"}


def flash_model(layers, experts: int, device="cuda", vocab: int = 129280):
    """V4-Flash's shapes (the config's defaults), `layers`, `experts` routed experts, bf16 with the
    float32 modules of a released checkpoint; the model's own initialisation, then the position
    bias, sinks and hash table drawn (it leaves them at 0)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    cfg = DeepseekV4Config(num_hidden_layers=len(layers), layer_types=list(layers), n_routed_experts=experts,
                           vocab_size=vocab, pad_token_id=None,
                           rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    with torch.device("meta"):
        m = DeepseekV4ForCausalLM(cfg)
    m = m.to_empty(device=device)
    m.init_weights()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("position_bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.5)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, experts, b.shape, generator=g, device=device))
    from kvatlas.integrations.transformers import as_checkpoint_loads
    return as_checkpoint_loads(m, torch.bfloat16).eval()


def drive(cache, model, tokens: int, device="cuda") -> None:
    """Bring `cache` (either kind) `tokens` further with the calls the model makes, random rows that
    depend only on the positions (two caches driven alike hold the same values); the overlap's gate
    carries the compressor's position bias, as the model's does."""
    config = model.config
    d, di = config.head_dim, config.index_head_dim
    done, start = 0, cache.get_seq_length()
    with torch.no_grad():
        while done < tokens:
            n = min(CHUNK, tokens - done)
            g = torch.Generator(device=device).manual_seed(start + done)
            rand = lambda *shape: torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
            for i, kind in enumerate(config.layer_types):
                kv = rand(1, 1, n, d)
                cache.update(kv, kv, i)
                names = {"sliding_attention": {}, "heavily_compressed_attention": {"compressor": (1, d)},
                         "compressed_sparse_attention": {"compressor": (2, d), "indexer": (2, di)}}[kind]
                layer = cache.layers[i]
                comp = model.model.layers[i].self_attn.compressor
                for name, (coff, width) in names.items():
                    ckv, cgate, _ = layer.store_compression_weights(name, rand(1, n, coff * width), rand(1, n, coff * width))
                    ratio = config.compress_rates[kind]
                    windows = ckv.shape[1] // ratio
                    if windows and coff == 2:
                        shape = (1, windows, ratio, coff * width)
                        bias = (comp if name == "compressor" else comp.indexer).position_bias
                        layer.update_overlap_state(name, ckv.view(shape), cgate.view(shape) + bias, width)
                    layer.update_compressor_states(name, rand(1, windows, width))
            done += n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steps(model, cache, n: int, token: int = 7) -> list[float]:
    x = torch.tensor([[token]], device=model.device)
    out = []
    with torch.no_grad():
        for _ in range(n):
            sync()
            t = time.perf_counter()
            model(input_ids=x, past_key_values=cache, use_cache=True)
            sync()
            out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="8192,65536,262144")
    ap.add_argument("--layouts", default="fp8,exact")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=16, help="untimed steps per cache at each context")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--layers", default="csa,hca,csa,hca")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="write a profile of a few steps per cache to this file")
    ap.add_argument("--breakdown", action="store_true",
                    help="after the timing, the host time of each cache method a step (wrapped timers), per cache")
    args = ap.parse_args()
    from transformers import DynamicCache
    from kvatlas.integrations.transformers import kvatlas_cache_for
    contexts = [int(c) for c in args.contexts.split(",")]
    layouts = args.layouts.split(",")
    t0 = time.perf_counter()
    layers = [KINDS[k] for k in args.layers.split(",")]
    dev = args.device
    m = flash_model(layers, args.experts, dev, args.vocab)
    where = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"model: {args.layers}, {sum(p.numel() for p in m.parameters()) / 1e9:.2f} B parameters, "
          f"built in {time.perf_counter() - t0:.1f} s; {where}", flush=True)
    most = max(contexts) + args.rounds * args.steps * (1 + len(layouts)) + 64
    caches = {"own": DynamicCache(config=m.config)}
    for lay in layouts:
        if lay == "own2":   # a control: a second own cache, timed like the others (what the ratios read on equal work)
            caches[lay] = DynamicCache(config=m.config)
            continue
        c = kvatlas_cache_for(m, "8GiB" if dev == "cuda" else "1GiB", layout=lay, max_running_requests=1,
                              max_model_len=most, chunked_prefill_tokens=CHUNK)
        c.kv.admit("r", most - 1, 1)
        caches[lay] = c.bind(["r"])
    results = []
    for ctx in contexts:
        for name, c in caches.items():
            drive(c, m, ctx - c.get_seq_length(), dev)
        sync()
        x = torch.tensor([[7]], device=dev)
        with torch.no_grad():   # the same rows in every cache: the exact layout reads what the own cache reads
            logits = {n: m(input_ids=x, past_key_values=c, use_cache=True).logits.float() for n, c in caches.items()}
        check = {f"{lay}_logits_vs_own": float((logits[lay] - logits["own"]).abs().max()) for lay in layouts}
        # warm-up, at every context: the allocator, the adapter's first passes, the kernels'
        # specializations (Triton compiles one per alignment and size class it meets: a window's
        # slots start one entry further each step), the device allocator's blocks of this size
        for _ in range(args.warmup):
            for name, c in caches.items():
                steps(m, c, 1)
        times = {name: [] for name in caches}
        order = list(caches)
        for i in range(args.rounds * args.steps):   # step by step, the caches in turn (rotating):
            for name in order[i % len(order):] + order[: i % len(order)]:   # drift hits them alike
                times[name] += steps(m, caches[name], 1)
        own = statistics.median(times["own"])
        row = {"context": ctx, "own_ms": own * 1e3}
        for lay in layouts:
            t = statistics.median(times[lay])
            row[f"{lay}_ms"], row[f"{lay}_tokens_per_s_ratio"] = t * 1e3, own / t
            # the same, step by step: each step against the own cache's step of the same turn
            # (next to it in time), the median of those ratios
            row[f"{lay}_paired_ratio"] = statistics.median(a / b for a, b in zip(times["own"], times[lay]))
        row["steps_ms"] = {n: [round(x * 1e3, 3) for x in v] for n, v in times.items()}
        row["lengths"] = {n: c.get_seq_length() for n, c in caches.items()}
        row.update(check)
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps_ms"}), flush=True)
    for lay in layouts:
        if lay != "own2":
            caches[lay].kv.check_integrity()
    print("\n| context | own cache step | " + " | ".join(f"{'own cache again' if lay == 'own2' else 'kvatlas ' + lay} step | "
                                                        "tokens/s vs own (paired)" for lay in layouts)
          + " |")
    print("|---|---|" + "---|---|" * len(layouts))
    for r in results:
        cells = " | ".join(f"{r[f'{lay}_ms']:.2f} ms | {r[f'{lay}_tokens_per_s_ratio']:.3f}x ({r[f'{lay}_paired_ratio']:.3f}x)"
                           for lay in layouts)
        print(f"| {r['context']:,} | {r['own_ms']:.2f} ms | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.profile:
        profile(m, caches, args.profile)
    if args.breakdown:
        breakdown(m, caches)


METHODS = ("update", "store_compression_weights", "update_overlap_state", "update_compressor_states")


def breakdown(model, caches, n: int = 30) -> None:
    """Host time a step in each method the model calls on a cache (and kvatlas's per-pass index
    building, `_begin`), by timers wrapped around them: what the adapter's Python and launches cost
    on the host, where the step's time goes when the model is launch-bound."""
    for name, c in caches.items():
        spent: dict = {}

        def timed(obj, attr, label):
            f = getattr(obj, attr)

            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            setattr(obj, attr, wrapper)
        if hasattr(c, "_begin"):
            timed(c, "_begin", "pass indices (_begin)")
        for i, layer in enumerate(c.layers):
            for meth in METHODS:
                if hasattr(layer, meth):
                    timed(layer, meth, f"{type(layer).__name__}.{meth}")
        total = sum(steps(model, c, n))
        for layer in c.layers:
            for meth in METHODS:
                layer.__dict__.pop(meth, None)
        c.__dict__.pop("_begin", None)
        cells = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in sorted(spent.items()))
        print(f"breakdown {name}: step {total / n * 1e3:.2f} ms; in the cache {sum(spent.values()) / n * 1e3:.3f} ms "
              f"({cells})", flush=True)


def profile(model, caches, out: str) -> None:
    """Per cache, 5 decode steps under the profiler: host waits on the device (synchronizations,
    pageable copies) and the ops that take the host's time, to a file; the waits per step printed."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    lines = []
    for name, c in caches.items():
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            steps(model, c, 5)
        ka = prof.key_averages()
        waits = {e.key: e.count / 5 for e in ka if "Synchronize" in e.key or "Memcpy" in e.key}
        launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")) / 5
        print(f"profile {name}: {launches:.0f} kernel launches a step; waits a step {waits}")
        lines += [f"== {name}", ka.table(sort_by="self_cpu_time_total", row_limit=30)]
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        steps(model, c, 10)
        pr.disable()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(40)
        lines += [f"== {name} (cProfile, 10 steps)", text.getvalue()]
    Path(out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
