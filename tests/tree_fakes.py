"""What the page tree (kvatlas.prefix.tree) asks of an allocator, for tests of the tree alone."""

from types import SimpleNamespace

import numpy as np


class TreeAlloc:
    """A full-page pool of `pages` (the nodes' ids) whose eviction only records the pages freed."""

    def __init__(self, pages: int = 64) -> None:
        self.freed: list[int] = []
        self.full = SimpleNamespace(owner=np.zeros(pages, np.int64))

    def evict_full(self, pages: np.ndarray) -> None:
        self.freed += pages.tolist()
