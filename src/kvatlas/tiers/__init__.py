"""Memory tiers below the device pools. `host`: pinned host memory for evicted cached pages and
checkpoints (see kvatlas.tiers.host)."""

from .host import HostTier
from .index import CheckpointAt, Claim, HostIndex, Offload
from .prefix_link import HostLink, Ready, attach_host_tier

__all__ = ["CheckpointAt", "Claim", "HostIndex", "HostLink", "HostTier", "Offload", "Ready", "attach_host_tier"]
