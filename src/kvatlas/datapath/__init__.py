"""The data path: cached entries in their real byte formats, and the compressor state.

Pure functions over torch tensors, so they plug into whatever pool objects hold the buffers.

Paged pools (buffers of `buffers.py`: uint8 [units, n_layers, page_bytes]):
    geom = PageGeometry(fmt, entries_per_page)
    store(geom, buffer, layers, slots, values, *, parallel=None, codec=None, validate=True, impl="auto")
    gather(geom, buffer, layers, slots, *, parallel=None, codec=None, validate=True, impl="auto") -> bf16
  `layers` is a layer position (values [n, width]) or a range (values [len, n, width]);
  slot = page_id * entries_per_page + offset; `parallel` is unified fp8's "<pool>.rope" buffer.
  compressed_slots(block_table, req_slots, block_ids, entries) maps compressed blocks to slots.
    entries_view(geom, buffer, layer)  a raw format's (bf16, fp32, fp64) entries as values
    PagedTarget.store / .gather        one layer of a pool, checked once, no per-call checks

Compressor state (state [slots, n_layers, ring, 2·coff·D], SPEC §4):
    clear_rows(state, req_slots, layers=...)                      a new request's rings
    compress_batch(state, layer, req_slots, positions, kv, score, *, ratio, ape=None) -> Blocks
    rollback(state, layers, req_slot, committed, written, *, ratio)
    online_compress_batch(state, layer, req_slots, positions, kv, score, *, ratio=128, ape=None)
    compress_sequence(kv, score, *, ratio, ape=None)               the whole-sequence oracle

One layer's whole write in a step (SWA entry, ring append, completed compressed entries and
indexer keys), one launch on CUDA, no host sync, capturable in a CUDA graph (see `write`):
    step = StepIndices.of(write_indices, device)                    once per step
    write_layer(step, LayerTargets.of_cache(cache, layer), swa_kv=..., kv=..., score=...,
                index_kv=..., index_score=...)                      per layer

Numerics of every format are documented in `codecs`; ring semantics in `compressor`. On CUDA,
Triton kernels take the hot paths (fp8_ds_mla and fp8 indexer store/gather, ring compression and
append) when triton is installed; the torch reference is the contract they are tested against.
"""

from .codecs import CODECS, Codec, codec_for
from .compressor import Blocks, CompressorSpec, clear_rows, compress_batch, compress_sequence, rollback
from .errors import DataPathError, NonFiniteError, OutOfRangeError, RingOverrunError, SlotError
from .geometry import PageGeometry, compressed_slots, entries_for_page_bytes
from .online import online_compress_batch
from .paged import entries_view, gather, layer_ops, store
from .step import LayerTargets, PagedTarget, RingTarget, StepIndices
from .write import write_layer

__all__ = [
    "CODECS", "Codec", "codec_for", "Blocks", "CompressorSpec", "clear_rows", "compress_batch",
    "compress_sequence", "rollback", "online_compress_batch", "DataPathError", "NonFiniteError",
    "OutOfRangeError", "RingOverrunError", "SlotError", "PageGeometry", "compressed_slots",
    "entries_for_page_bytes", "entries_view", "gather", "layer_ops", "store", "LayerTargets", "PagedTarget", "RingTarget", "StepIndices",
    "write_layer",
]
