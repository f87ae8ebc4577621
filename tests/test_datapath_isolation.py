"""Isolation: a store touches only the bytes of the slots it names; requests that come and go
over reused pages read back only their own entries."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.datapath import CODECS, PageGeometry, gather, store

NAMES = sorted(CODECS)


def owned_mask(geom, buf_shape, layer, slots, parallel=False):
    """Bytes of the named slots' entries in one layer (data + scale, or the parallel row)."""
    mask = torch.zeros(buf_shape, dtype=torch.bool)
    for s in slots:
        page, off = divmod(int(s), geom.entries)
        spans = [geom.parallel_span(off)] if parallel else [geom.data_span(off), geom.scale_span(off)]
        for a, b in spans:
            mask[page, layer, a:b] = True
    return mask


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NAMES), entries=st.sampled_from([1, 2, 3, 4]), data=st.data())
def test_store_touches_only_its_slots(name, entries, data):
    codec = CODECS[name]
    geom = PageGeometry(codec.fmt, entries)
    units, layers = 4, 2
    total = units * entries
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    buf = torch.randint(0, 256, (units, layers, geom.page_bytes), dtype=torch.uint8, generator=gen)
    par = (torch.randint(0, 256, (units, layers, geom.parallel_page_bytes), dtype=torch.uint8, generator=gen)
           if codec.fmt.parallel_bytes else None)
    slots = data.draw(st.lists(st.integers(entries, total - 1), min_size=1, max_size=total - entries, unique=True))
    layer = data.draw(st.integers(0, layers - 1))
    before, before_par = buf.clone(), (par.clone() if par is not None else None)
    x = torch.randn(len(slots), codec.width, generator=gen).bfloat16()
    store(geom, buf, layer, torch.tensor(slots), x, parallel=par)
    mine = owned_mask(geom, buf.shape, layer, slots)
    assert torch.equal(buf[~mine], before[~mine])
    if par is not None:
        pm = owned_mask(geom, par.shape, layer, slots, parallel=True)
        assert torch.equal(par[~pm], before_par[~pm])
    want = codec.decode(codec.encode(x))
    assert torch.equal(gather(geom, buf, layer, torch.tensor(slots), parallel=par), want)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["fp8_ds_mla", "bf16", "indexer_fp4", "unified_fp8"]), data=st.data())
def test_lifecycle_with_page_reuse(name, data):
    """Requests take pages from a free list, write token by token, finish and give the pages back;
    a new owner of a reused page reads only what it wrote, never the previous owner's entries."""
    codec = CODECS[name]
    entries, units = 2, 7
    geom = PageGeometry(codec.fmt, entries)
    buf = torch.zeros(units, 1, geom.page_bytes, dtype=torch.uint8)
    par = torch.zeros(units, 1, geom.parallel_page_bytes, dtype=torch.uint8) if codec.fmt.parallel_bytes else None
    free, live, next_id = list(range(1, units)), {}, 0   # page 0 is the null page
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["start", "write", "finish"]))
        if op == "start" and free:
            live[next_id] = {"pages": [free.pop(0)], "values": []}
            next_id += 1
        elif op == "write" and live:
            req = live[data.draw(st.sampled_from(sorted(live)))]
            pos = len(req["values"])
            if pos // entries == len(req["pages"]):
                if not free:
                    continue
                req["pages"].append(free.pop(0))
            x = torch.randn(1, codec.width, generator=gen).bfloat16()
            slot = req["pages"][pos // entries] * entries + pos % entries
            store(geom, buf, 0, torch.tensor([slot]), x, parallel=par)
            req["values"].append(codec.decode(codec.encode(x))[0])
        elif op == "finish" and live:
            rid = data.draw(st.sampled_from(sorted(live)))
            free.extend(live.pop(rid)["pages"])
        for req in live.values():   # every live request reads exactly its own entries
            n = len(req["values"])
            if n:
                slots = torch.tensor([req["pages"][p // entries] * entries + p % entries for p in range(n)])
                assert torch.equal(gather(geom, buf, 0, slots, parallel=par), torch.stack(req["values"]))
