"""Memory tiers below the device pools. `host`: pinned host memory for evicted cached pages and
checkpoints (see kvatlas.tiers.host)."""

from .host import CheckpointAt, HostTier, Offload

__all__ = ["CheckpointAt", "HostTier", "Offload"]
