"""Storage tiers: the node-local directory (NVMe, written by the checkpoint engine through ``fileio``) and
durable tiers behind one :class:`~.tier.StorageTier` interface: POSIX directories (Lustre or any shared
filesystem) and S3. :func:`~.registry.open_tier` maps a URL to a tier, importing backends lazily."""

from .registry import open_durable, open_tier, parse_url
from .tier import ObjectInfo, RateLimiter, StorageTier, TransferStats, join_key

__all__ = ["open_durable", "ObjectInfo", "RateLimiter", "StorageTier", "TransferStats", "join_key", "open_tier", "parse_url"]
