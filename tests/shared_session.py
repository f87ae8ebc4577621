"""A cache process with a shared tier under its host tier, and its cold twin: the prefix cache's
exactness session (prefix_session.Session) with every admission first prefetching through
device → host → shared. Runs as the test process, or as a separate process:

    python tests/shared_session.py URL SEED[,SEED...] [--prompts N] [--policy finish] [--writer N]   (prints a JSON summary)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefix_session import CHUNK, Session, make_plan  # noqa: E402

from kvatlas.tiers.shared import attach_shared_tier  # noqa: E402

HOST = "4MiB"


def prompts(seed: int, n: int = 2, length: int = 520) -> list:
    """A conversation: each prompt re-sends the one before and adds to it (content from `seed`)."""
    rng = np.random.default_rng(seed)
    seq, out = rng.integers(0, 50_000, length), []
    for _ in range(n):
        out.append(seq.copy())
        seq = np.concatenate((seq, rng.integers(0, 50_000, 260)))[:1800]
    return out


class SharedSession(Session):
    def __init__(self, store, *, host=HOST, model="tiny-v4", **link_options):
        super().__init__(make_plan(0, model))
        self.link = attach_shared_tier(self.hot, host, store, checkpoint_share=0.5, outbox_bytes="2MiB",
                                       **link_options)
        self.ready = None

    def admit(self, seq, prompt, max_new):
        self.ready = self.link.prefetch(prompt, token_ids=np.asarray(seq[:prompt], np.int64))
        if self.ready is not None:
            self.ready.wait()        # before the request's first forward pass
        super().admit(seq, prompt, max_new)

    def check(self, where):
        super().check(where)
        self.link.tier.check_integrity()

    def run(self, prompt_ids, max_new: int = 2) -> int:
        """One request through both twins, reads compared after every pass; its cached tokens."""
        seq = np.concatenate((prompt_ids, np.arange(max_new) + 7))
        before = self.hot.prefix.stats.hit_tokens
        self.admit(seq, len(prompt_ids), max_new)
        rid = f"r{self.next_id - 1}"
        r = self.running[rid]
        while r.written < r.prompt:
            self.extend(rid, min(CHUNK, r.prompt - r.written))
            self.check(f"{rid} prefill")
        while r.written < len(r.seq):
            self.step(rid, 1, 1)
            self.check(f"{rid} decode")
        self.finish(rid)
        self.check(f"{rid} finish")
        return self.hot.prefix.stats.hit_tokens - before

    def close(self):
        self.link.shared.flush(5.0)
        snap = self.link.shared_snapshot()
        self.hot.close()
        return snap


def admit_only(s, seq) -> int:
    """Prefetch and admit one prompt on a SharedSession's hot cache (no writes): its cached tokens."""
    ready = s.link.prefetch(len(seq), token_ids=seq)
    if ready is not None:
        ready.wait()
    s.next_id += 1
    rid = f"a{s.next_id}"
    cached = s.hot.admit(rid, len(seq), 2, token_ids=seq).cached_tokens
    s.hot.finish(rid)   # a caller that retries until a hit must not run out of request slots
    return cached


class Writer:
    """A writing process's cache: the hot cache alone (no cold twin, no read checks), each
    request's rows written from its token ids (prefix_model), finished and written through."""

    def __init__(self, store, prefetch: bool = True, model="tiny-v4", **link_options):
        from prefix_model import Model

        from kvatlas import allocate
        self.cache = allocate(make_plan(0, model))
        self.link = attach_shared_tier(self.cache, HOST, store, checkpoint_share=0.5, outbox_bytes="2MiB",
                                       **link_options)
        self.model, self.prefetch, self.n = Model(self.cache, "torch"), prefetch, 0

    def run(self, prompt, max_new: int = 2) -> int:
        """One request; its cached tokens."""
        from prefix_model import prefix_hashes
        cache = self.cache
        seq = np.concatenate((prompt, np.arange(max_new) + 7))
        h, rid = prefix_hashes(seq), f"w{self.n}"
        self.n += 1
        ready = self.link.prefetch(len(prompt), token_ids=prompt) if self.prefetch else None
        if ready is not None:
            ready.wait()
        done = cached = cache.admit(rid, len(prompt), max_new, token_ids=prompt).cached_tokens
        while done < len(seq):
            n = min(CHUNK, len(prompt) - done) if done < len(prompt) else 1
            self.model.write(cache.extend(rid, n) if done < len(prompt) else cache.step([rid], 1), h[done:done + n])
            done += n
        cache.finish(rid, token_ids=seq)
        cache.check_integrity()
        return cached

    def close(self, timeout_s: float = 10.0):
        self.link.shared.flush(timeout_s)
        snap = self.link.shared_snapshot()
        self.cache.close()
        return snap


def write_through(store, seqs, max_new: int = 2, prefetch: bool = True, **link_options):
    """The writing process (a Writer) runs each prompt: (cached tokens of each, its snapshot)."""
    w = Writer(store, prefetch, **link_options)
    cached = [w.run(prompt, max_new) for prompt in seqs]
    return cached, w.close()


def main(argv) -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("seeds", help="comma-separated: one conversation each")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--policy", default="finish")
    ap.add_argument("--writer", type=int, default=1)
    ap.add_argument("--no-prefetch", action="store_true", help="compute every prompt, even what the store holds")
    a = ap.parse_args(argv)
    seqs = [p for seed in a.seeds.split(",") for p in prompts(int(seed), a.prompts)]
    cached, snap = write_through(a.url, seqs, policy=a.policy, writer=a.writer, prefetch=not a.no_prefetch)
    print(json.dumps({"cached": cached, "puts": snap.puts, "errors": snap.errors}))


if __name__ == "__main__":
    main(sys.argv[1:])
