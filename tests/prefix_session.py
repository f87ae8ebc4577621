"""The prefix-cache exactness session: a hot cache (prefix caching, token ids given) and a cold
twin (never hits) driven through the same requests; `check` compares what every running request
reads in both. Kept free of hypothesis so the GPU run needs only torch."""

import numpy as np

from kvatlas import allocate, plan
from kvatlas.errors import PoolExhaustedError
from prefix_model import Model, assert_same_reads, prefix_hashes

CHUNK = 256


class Req:
    def __init__(self, seq, prompt):
        self.seq, self.prompt = np.asarray(seq, np.int64), prompt
        self.hashes = prefix_hashes(self.seq)
        self.written = 0


def make_plan(draft_tokens, model="tiny-v4"):
    # pipeline stage 0 of 2: one SWA-only, one C4 and one C128 layer, half the work of all six
    return plan(model, "16MiB", max_model_len=2048, max_running_requests=2, prefix_checkpoints=2,
                chunked_prefill_tokens=CHUNK, draft_tokens=draft_tokens, pp=2)


class Session:
    def __init__(self, p, device="cpu", impl="torch"):
        self.hot, self.cold = allocate(p, device=device), allocate(p, device=device)
        self.mh, self.mc = Model(self.hot, impl), Model(self.cold, impl)
        self.draft = p.options.draft_tokens
        self.running: dict = {}
        self.done: list = []
        self.next_id = 0
        self.hits = 0

    def check(self, where):
        self.hot.check_integrity()
        self.cold.check_integrity()
        for rid, r in self.running.items():
            if r.written:
                assert_same_reads(self.mh.reads(rid), self.mc.reads(rid), f"{where} {rid}")

    def write(self, rid, n, hashes, fn):
        self.mh.write(fn(self.hot), hashes)
        self.mc.write(fn(self.cold), hashes)

    def admit(self, seq, prompt, max_new):
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Req(seq, prompt)
        ok = self.hot.can_admit(prompt, max_new, token_ids=r.seq[:prompt])
        try:
            adm = self.hot.admit(rid, prompt, max_new, token_ids=r.seq[:prompt])
        except PoolExhaustedError:
            assert not ok, "can_admit said yes, admit refused"
            return
        assert ok, "admit succeeded where can_admit said no"
        self.cold.admit(rid, prompt, max_new)
        self.running[rid] = r
        self.hits += adm.cached_tokens > 0
        done = 0
        while done < adm.cached_tokens:   # the cold twin computes what the hot one took from the cache
            n = min(CHUNK, adm.cached_tokens - done)
            self.mc.write(self.cold.extend(rid, n), r.hashes[done:done + n])
            done += n
        r.written = adm.cached_tokens

    def extend(self, rid, n):
        r = self.running[rid]
        h = r.hashes[r.written:r.written + n]
        self.mh.write(self.hot.extend(rid, n), h)
        self.mc.write(self.cold.extend(rid, n), h)
        r.written += n

    def step(self, rid, tokens, accepted):
        r = self.running[rid]
        h = r.hashes[r.written:r.written + accepted]
        if tokens > accepted:   # rejected drafts: other tokens after the accepted ones
            seed = int(r.hashes[r.written + accepted - 1])
            h = np.concatenate((h, prefix_hashes(-1 - np.arange(tokens - accepted), seed)))
        self.mh.write(self.hot.step([rid], tokens), h)
        self.mc.write(self.cold.step([rid], tokens), h)
        for c in (self.hot, self.cold):
            c.rollback(rid, tokens - accepted)
        r.written += accepted

    def finish(self, rid):
        r = self.running.pop(rid)
        self.hot.finish(rid, token_ids=r.seq[:r.written])
        self.cold.finish(rid)
        self.done.append(r.seq[:r.written])


def scripted(device="cpu", impl="torch", draft_tokens=3):
    """Hits for sure: a shared system prompt, a follow-up turn, drafts with rejections, chunks
    that end off the page boundaries, and eviction of the oldest pages (16 pages in all)."""
    s = Session(make_plan(draft_tokens), device, impl)
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50_000, 600)
    a = np.concatenate((system, rng.integers(0, 50_000, 120)))
    for rid_seq, prompt in ((np.concatenate((a, rng.integers(0, 50_000, 9))), 720),):
        s.admit(rid_seq, prompt, 9)
    rid = "r0"
    for n in (100, 256, 256, 108):
        s.extend(rid, n)
        s.check(f"extend {n}")
    for tokens, accepted in ((4, 2), (4, 4), (1, 1), (3, 1), (2, 1)):   # 9 accepted: the whole output
        s.step(rid, tokens, accepted)
        s.check(f"step {tokens}/{accepted}")
    s.finish(rid)
    s.check("finish r0")
    turn = np.concatenate((s.done[0], rng.integers(0, 50_000, 200)))
    s.admit(np.concatenate((turn, rng.integers(0, 50_000, 4))), len(turn), 4)
    s.admit(np.concatenate((system, rng.integers(0, 50_000, 300), rng.integers(0, 50_000, 4))), 900, 4)
    assert s.hits == 2, "both the follow-up turn and the shared system prompt hit"
    for rid in sorted(s.running):
        r = s.running[rid]
        while r.written < r.prompt:
            s.extend(rid, min(CHUNK, r.prompt - r.written))
            s.check(f"extend {rid}")
        s.step(rid, min(1 + s.draft, len(r.seq) - r.written), 1)
        s.check(f"step {rid}")
    for rid in sorted(s.running):
        s.finish(rid)
    for i in range(3):   # fill the cache with other prompts: the oldest pages are evicted
        s.admit(rng.integers(0, 50_000, 1500), 1400, 40)
        rid = f"r{s.next_id - 1}"
        if rid in s.running:
            while s.running[rid].written < 1400:
                s.extend(rid, min(CHUNK, 1400 - s.running[rid].written))
            s.check(f"filler {i}")
            s.finish(rid)
    assert s.hot.prefix.stats.evicted_pages > 0
    s.check("end")
    return s


