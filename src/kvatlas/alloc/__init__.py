"""Request lifecycle over every pool: slots, full-token pages, SWA pages, state rows."""

from .allocator import Allocator
from .indices import Admission, WriteIndices

__all__ = ["Admission", "Allocator", "WriteIndices"]
