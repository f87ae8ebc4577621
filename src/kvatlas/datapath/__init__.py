"""The data path: cached entries in their real byte formats, and the compressor state.

Pure functions over torch tensors, so they work on whatever pool objects hold the buffers:
- `store` / `gather` (paged): quantize bf16 rows into a pool buffer by slot, read them back;
- `codecs`: one codec per row format of `formats` (the numerics, documented there);
- `compressor`: ring append + block compression (C4 overlapped, C128), rollback of drafts;
- `online`: the one-row online C128 state.
On CUDA, Triton kernels take the hot paths when triton is installed; the torch reference is the
contract they are tested against.
"""

from .codecs import CODECS, Codec, codec_for
from .errors import DataPathError, NonFiniteError, OutOfRangeError, RingOverrunError, SlotError
from .geometry import PageGeometry, compressed_slots, entries_for_page_bytes
from .paged import gather, store

__all__ = [
    "CODECS", "Codec", "codec_for", "DataPathError", "NonFiniteError", "OutOfRangeError",
    "RingOverrunError", "SlotError", "PageGeometry", "compressed_slots", "entries_for_page_bytes",
    "gather", "store",
]
