"""Where an entry's bytes sit inside a page: every offset is derived from `formats.RowFormat`.

A page of P entries is a data region (P × data_bytes) then a scale region (P × scale_bytes),
rounded up to the format's alignment (FlashMLA's block-split layout, SPEC §2; V4.1 rows use the
same block-split arrangement, as SGLang's `KVLayout.V41` does). A format with `parallel_bytes`
keeps a second buffer of P × parallel_bytes per page (unified fp8's rope rows).

Slot addressing follows the engines: slot = page_id * P + offset, so slots 0..P-1 are page 0,
the null page that padded writes may target.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.formats import RowFormat
from .errors import SlotError


@dataclass(frozen=True, slots=True)
class PageGeometry:
    fmt: RowFormat
    entries: int  # P: entries per page (per layer)

    def __post_init__(self) -> None:
        if self.entries < 1:
            raise SlotError("entries", f"{self.entries} entries per page", "use at least 1")

    @property
    def page_bytes(self) -> int:
        return self.fmt.page_bytes(self.entries)

    @property
    def parallel_page_bytes(self) -> int:
        return self.fmt.parallel_page_bytes(self.entries)

    @property
    def scale_region(self) -> int:
        """Byte offset of the scale region inside a page."""
        return self.entries * self.fmt.data_bytes

    def data_span(self, offset: int) -> tuple[int, int]:
        start = offset * self.fmt.data_bytes
        return start, start + self.fmt.data_bytes

    def scale_span(self, offset: int) -> tuple[int, int]:
        start = self.scale_region + offset * self.fmt.scale_bytes
        return start, start + self.fmt.scale_bytes

    def parallel_span(self, offset: int) -> tuple[int, int]:
        start = offset * self.fmt.parallel_bytes
        return start, start + self.fmt.parallel_bytes

    def split(self, slots):
        """(page ids, offsets within the page) of integer slot tensors."""
        return slots // self.entries, slots % self.entries

    def check_buffer(self, buffer, name: str = "buffer", parallel: bool = False) -> None:
        want = self.parallel_page_bytes if parallel else self.page_bytes
        if buffer.dim() != 3 or buffer.shape[-1] != want:
            raise SlotError(name, f"shape {tuple(buffer.shape)} is not [units, layers, {want}]",
                            f"pass the {self.fmt.name} buffer of {self.entries}-entry pages")
        if str(buffer.dtype) != "torch.uint8":
            raise SlotError(name, f"dtype {buffer.dtype}", "pass the pool's uint8 buffer")

    def num_slots(self, buffer) -> int:
        return buffer.shape[0] * self.entries


def entries_for_page_bytes(fmt: RowFormat, page_bytes: int) -> int:
    """Invert `fmt.page_bytes`: page bytes grow strictly with entries, so at most one P fits."""
    per = fmt.data_bytes + fmt.scale_bytes
    guess = max(1, page_bytes // per)
    for p in (guess, guess - 1, guess + 1):
        if p >= 1 and fmt.page_bytes(p) == page_bytes:
            return p
    raise SlotError("page_bytes", f"{page_bytes} B is no page size of {fmt.name}",
                    "pass the entries per page explicitly")


def compressed_slots(block_table, req_slots, block_ids, entries: int):
    """Physical slots of compressed entries: block i of a request lives on the full page
    block_table[req, i // P] at offset i % P (page boundaries line up across pools, SPEC §3)."""
    pages = block_table[req_slots.long(), (block_ids // entries).long()].long()
    return pages * entries + block_ids % entries
