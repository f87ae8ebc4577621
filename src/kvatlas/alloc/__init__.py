"""Request lifecycle over every pool: slots, full-token pages, SWA pages, state rows."""

from .allocator import Allocator
from .indices import Admission, RequestBatch, WriteIndices

__all__ = ["Admission", "Allocator", "RequestBatch", "WriteIndices"]
