"""The prefix cache: content keys, the page tree, resume points (checkpoints), their policies and
eviction. It stands beside cache/ and above alloc/: the allocator only holds the pages and counts
who reads them (kvatlas.alloc.sharing)."""

from .cache import PrefixCache, SharedPrefix
from .keys import PromptKeys, page_keys
from .policy import POLICIES, policy_named
from .stats import MISS_REASONS, PrefixStats

__all__ = ["MISS_REASONS", "POLICIES", "PrefixCache", "PrefixStats", "PromptKeys", "SharedPrefix", "page_keys", "policy_named"]
