"""audit(): every storage counted once, to the byte, on hand-built object graphs (CPU only)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")

from kvatlas.cache.audit import AuditReport, audit  # noqa: E402
from kvatlas.errors import ConfigError  # noqa: E402


class Box:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_views_of_one_base_count_the_base_once():
    base = torch.zeros(100, dtype=torch.float32)
    r = audit(Box(a=base[10:20], b=base.view(10, 10), c=base.view(10, 10).T, d=base.narrow(0, 5, 5)))
    assert (r.total_bytes, r.num_storages, r.num_tensors) == (400, 1, 4)
    (e,) = r.entries
    assert (e.path, e.shape, e.dtype, e.device) == (".a", (10,), "float32", "cpu")
    assert e.aliases == (".b", ".c", ".d")


def test_same_tensor_at_two_paths_is_an_alias():
    t = torch.ones(3, 5, dtype=torch.float16)
    r = audit(Box(x=t, y=t, z=[t]), root="obj")
    assert (r.total_bytes, r.num_tensors) == (30, 1)
    assert r.entries[0].path == "obj.x" and r.entries[0].aliases == ("obj.y", "obj.z[0]")


def test_views_at_different_offsets_keep_the_whole_base_alive():
    base = torch.empty(1024, dtype=torch.int8)
    head, tail = base[:100], base[500:]
    del base  # only the views remain, yet they pin all 1024 bytes
    r = audit({"head": head, "tail": tail})
    assert r.total_bytes == 1024 and r.num_storages == 1
    assert r.entries[0].path == "['head']" and r.entries[0].aliases == ("['tail']",)


def test_cycles_terminate():
    me = Box(t=torch.zeros(2, dtype=torch.int64))
    me.me = me
    a, b = Box(), Box(u=torch.zeros(3, dtype=torch.int32))
    a.b, b.a = b, a
    loop = [a]
    loop.append(loop)
    r = audit({"me": me, "loop": loop, "a": a})
    assert r.total_bytes == 16 + 12 and not r.truncated
    # BFS: the shortest way in names the storage; the longer one through the cycle is an alias
    assert [e.path for e in r.entries] == ["['me'].t", "['a'].b.u"]
    assert r.entries[1].aliases == ()  # b was walked once, under its first path


@dataclasses.dataclass
class KV:
    k: object
    v: object


class NT(NamedTuple):
    k: object
    v: object


def test_nested_containers_give_readable_paths():
    t = [torch.zeros(4, dtype=torch.bfloat16) for _ in range(4)]
    r = audit({"layers": [(KV(k=t[0], v=t[1]), NT(k=t[2], v=t[3]))], 7: {t[0]}})
    assert [e.path for e in r.entries] == [  # BFS: the set at depth 2 reaches t[0] first
        "[7]{0}", "['layers'][0][0].v", "['layers'][0][1].k", "['layers'][0][1].v"]
    assert r.total_bytes == 32 and r.entries[0].aliases == ("['layers'][0][0].k",)


def test_frozen_slotted_dataclass():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Spec:
        buf: object

    assert audit(Spec(buf=torch.zeros(6, dtype=torch.float64))).entries[0].path == ".buf"


class Base:
    __slots__ = ("a",)


class Child(Base):
    __slots__ = ("b", "__p", "unset")


class WithDict(Child):  # no __slots__: instances also get a __dict__
    pass


def test_slots_inherited_private_and_dict():
    o = WithDict()
    o.a, o.b = torch.zeros(1, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)
    o._Child__p, o.c = torch.zeros(4, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    r = audit(o)
    assert [(e.path, e.bytes) for e in r.entries] == [(".a", 1), (".b", 2), ("._Child__p", 4), (".c", 8)]


class Counting:
    calls = 0
    tensor_on_class = torch.zeros(1000)  # class attributes are not instance state

    @property
    def lazy(self):
        Counting.calls += 1
        return torch.zeros(1000)

    def __getattr__(self, name):  # a proxy that would answer anything
        Counting.calls += 1
        return torch.zeros(1000)


def test_properties_classes_functions_and_modules_are_not_followed():
    hidden = torch.zeros(1000)

    def fn(x=hidden):
        return x

    o = Counting()
    o.real = torch.zeros(5, dtype=torch.int16)
    r = audit(Box(o=o, cls=Counting, fn=fn, mod=sys.modules[__name__], bound=o.__init__))
    assert r.total_bytes == 10 and Counting.calls == 0


class DeepSeekV4TokenToKVPool:
    """Mimics SGLang's pool: per-layer buffer lists, state dicts, one shared index, no accounting."""

    def __init__(self):
        self.swa_kv_buffer = [torch.zeros(64, 584, dtype=torch.uint8) for _ in range(4)]
        self.c4_kv_buffer = [torch.zeros(16, 584, dtype=torch.uint8) for _ in range(2)]
        slab = torch.zeros(2 * 4 * 584, dtype=torch.uint8)  # carved into per-layer views
        self.c128_kv_buffer = [slab[i * 2336:(i + 1) * 2336].view(4, 584) for i in range(2)]
        self.c4_indexer_buffer = [torch.zeros(16, 132, dtype=torch.uint8) for _ in range(2)]
        self.compress_state = {"c4": [torch.zeros(8, 4, 64) for _ in range(2)],
                               "c128": [torch.zeros(8, 128, 16, dtype=torch.bfloat16)]}
        self.req_to_token = torch.zeros(8, 256, dtype=torch.int32)
        self.swa_req_to_token = self.req_to_token
        self.full_to_swa_index_mapping = torch.arange(65, dtype=torch.int64)
        self.layer_num, self.dtype, self.device = 4, torch.uint8, torch.device("cpu")

    @property
    def kv_buffer(self):  # engines expose buffers like this; evaluating it must not happen
        raise AssertionError("audit called a property")


def test_deepseek_v4_pool_mock_to_the_byte():
    r = audit(DeepSeekV4TokenToKVPool(), root="pool")
    assert r.bytes_under("pool.swa_kv_buffer") == 4 * 64 * 584 == 149504
    assert r.bytes_under("pool.c4_kv_buffer") == 18688
    assert r.bytes_under("pool.c128_kv_buffer") == 4672  # the slab, once
    assert r.bytes_under("pool.c4_indexer_buffer") == 4224
    assert r.bytes_under("pool.compress_state['c4']") == 16384
    assert r.bytes_under("pool.compress_state['c128']") == 32768
    assert r.bytes_under("pool.req_to_token") == 8192
    assert r.bytes_under("pool.swa_req_to_token") == 0
    assert r.total_bytes == 234952 and r.by_device == {"cpu": 234952}
    assert (r.num_storages, r.num_tensors, r.truncated) == (14, 15, False)
    shared = next(e for e in r.entries if e.path == "pool.req_to_token")
    assert shared.aliases == ("pool.swa_req_to_token",) and shared.dtype == "int32"
    c128 = next(e for e in r.entries if e.path == "pool.c128_kv_buffer[0]")
    assert c128.aliases == ("pool.c128_kv_buffer[1]",) and c128.shape == (4, 584)


def _linked_list(n):
    head = node = Box()
    for _ in range(n - 1):
        node.next = Box(value=1)
        node = node.next
    node.tail = torch.zeros(7, dtype=torch.uint8)
    return head


def test_huge_graph_is_fast_and_caps_truncate():
    # Linear, not quadratic, in the graph's size (paths built by concatenation once went
    # quadratic: 100x): 10x the nodes may cost at most 30x the time, measured in the same run, so
    # a busy machine slows both sides alike (an absolute time limit failed under load); the
    # larger side's best of two runs, as one run once met a burst of load (2.5 s against 2.3 s)
    small = _linked_list(20_000)
    start = time.perf_counter()
    audit(small, max_depth=10**6)
    small_s = time.perf_counter() - start
    head = _linked_list(200_000)
    large_s = []
    for _ in range(2):
        start = time.perf_counter()
        r = audit(head, max_depth=10**6)
        large_s.append(time.perf_counter() - start)
    assert min(large_s) < 30 * small_s + 0.5
    assert r.total_bytes == 7 and not r.truncated
    assert r.entries[0].path == ".next" * 199_999 + ".tail"
    capped = audit(head, max_objects=1000, max_depth=10**6)
    assert capped.truncated and capped.total_bytes == 0
    shallow = audit(head)  # default max_depth=64
    assert shallow.truncated and shallow.total_bytes == 0


def test_depth_cap_ignores_leaves():
    assert not audit([[[1, "x", None]]], max_depth=2).truncated
    assert audit([[[[1]]]], max_depth=2).truncated


@pytest.mark.parametrize("dtype,nbytes", [
    (torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4), (torch.float64, 8),
    (torch.int8, 1), (torch.int64, 8), (torch.bool, 1), (torch.float8_e4m3fn, 1), (torch.complex64, 8),
])
def test_dtypes(dtype, nbytes):
    r = audit([torch.zeros(3, 7, dtype=dtype)])
    assert r.total_bytes == 21 * nbytes and r.entries[0].dtype == str(dtype).removeprefix("torch.")


def test_parameter_module_and_subclass():
    lin = torch.nn.Linear(4, 3)
    r = audit({"lin": lin, "p": torch.nn.Parameter(torch.zeros(3, 4))})
    assert r.bytes_under("['lin']._parameters") == 48 + 12 and r.bytes_under("['p']") == 48

    class Tagged(torch.Tensor):
        pass

    t = torch.zeros(10, dtype=torch.int32).as_subclass(Tagged)
    assert audit(Box(t=t)).total_bytes == 40


def test_tensor_dict_keys():
    k, v = torch.zeros(2), torch.zeros(3)
    r = audit({k: v})
    assert [(e.path, e.bytes) for e in r.entries] == [(".keys()[0]", 8), ("[<Tensor #0>]", 12)]


def test_meta_empty_and_storageless_tensors_count_zero():
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,),
                                     check_invariants=True)
    meta = torch.empty(1 << 30, device="meta")
    r = audit([meta, meta[:10], torch.empty(0), torch.empty(0), sparse])
    assert r.total_bytes == 0 and r.num_storages == 5 and r.entries[0].aliases == ()
    assert "meta" in r.entries[0].note and "no storage" in r.entries[4].note


def test_report_is_frozen_and_json_ready():
    r = audit(Box(a=torch.zeros(2, 3)))
    assert isinstance(r, AuditReport)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.total_bytes = 0
    d = json.loads(json.dumps(r.to_dict()))
    assert d["schema_version"] == 1 and d["total_bytes"] == 24
    assert d["entries"] == [{"path": ".a", "bytes": 24, "device": "cpu", "dtype": "float32",
                             "shape": [2, 3], "aliases": [], "note": ""}]


def test_bad_caps_are_rejected():
    with pytest.raises(ConfigError, match="max_objects"):
        audit([], max_objects=0)
    with pytest.raises(ConfigError, match="max_depth"):
        audit([], max_depth=-1)


def test_import_is_torch_free_and_missing_torch_is_explained():
    code = ("import sys, kvatlas; assert 'torch' not in sys.modules; sys.modules['torch'] = None\n"
            "try: kvatlas.audit([])\nexcept ImportError as e: print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'kvatlas[torch]'" in out.stdout
