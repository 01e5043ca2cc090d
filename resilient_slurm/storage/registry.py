"""URL -> storage tier, with lazily imported backends (fsspec-style): ``/path`` and ``file:///path`` open a
:class:`~.posix.PosixTier`, ``s3://bucket/prefix`` an :class:`~.s3.S3Tier` (boto3 imported on first use,
with an install hint when it is missing)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from ..errors import ConfigError
from .tier import RateLimiter, StorageTier

if TYPE_CHECKING:  # for annotations only: config imports this module to check URLs
    from ..config import Settings

# scheme -> (module, class, pip extra that provides its dependency)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "file": ("resilient_slurm.storage.posix", "PosixTier", None),
    "s3": ("resilient_slurm.storage.s3", "S3Tier", "s3"),
}


def register(scheme: str, module: str, cls: str, extra: str | None = None) -> None:
    """Register a backend for ``scheme://`` URLs (imported on first use)."""
    _BACKENDS[scheme] = (module, cls, extra)


def parse_url(url: str) -> tuple[str, str]:
    """``(scheme, location)``: ``file`` and an absolute path, or ``s3`` and ``bucket/prefix``."""
    if not url or not url.strip():
        raise ConfigError("durable: empty URL; use /path, file:///path or s3://bucket/prefix (RSLURM_DURABLE)")
    u = urlparse(url)
    if u.scheme in ("", "file"):
        path = unquote(u.path) if u.scheme == "file" else url
        if u.scheme == "file" and u.netloc not in ("", "localhost"):
            raise ConfigError(f"durable={url!r}: file URLs name a local path (file:///path), not a host")
        if "\0" in path or not os.path.isabs(os.path.expanduser(path)):
            # A relative path would be a different tier from every directory a command runs in (and
            # file:// names none at all): every node's daemon and every restore must find the same one.
            raise ConfigError(f"durable={url!r}: "
                              + ("names no directory" if not path.strip() else "not an absolute path")
                              + "; use /absolute/path, file:///absolute/path or s3://bucket/prefix (RSLURM_DURABLE)")
        return "file", path
    if u.scheme not in _BACKENDS:
        raise ConfigError(f"durable={url!r}: unknown scheme {u.scheme!r}; use one of "
                          + ", ".join(f"{s}://" for s in sorted(_BACKENDS)) + " or a plain path")
    if u.scheme == "s3" and not u.netloc:
        raise ConfigError(f"durable={url!r}: no bucket; use s3://bucket/prefix")
    return u.scheme, (u.netloc + u.path).rstrip("/")


def open_tier(url: str, *, threads: int = 8, bandwidth: float | None = None,
              limiter: RateLimiter | None = None, create: bool = True, **options: Any) -> StorageTier:
    """Open the tier for ``url``. ``bandwidth`` (bytes/s) caps every transfer of the tier together;
    ``options`` go to the backend (S3: ``endpoint_url``, ``part_size``, ``max_attempts``, ...). ``create``:
    a directory tier makes its root now (False: a reader, to which a root not there is an empty tier; a
    write still makes the directories it needs)."""
    scheme, location = parse_url(url)
    module, cls, extra = _BACKENDS[scheme]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = f" (pip install 'resilient_slurm[{extra}]')" if extra else ""
        raise ConfigError(f"durable={url!r} needs {exc.name or 'a missing module'}{hint}") from exc
    factory: Callable[..., StorageTier] = getattr(mod, cls)
    limiter = limiter or RateLimiter(bandwidth)
    if scheme == "file":
        return factory(location, threads=threads, limiter=limiter, create=create)
    return factory(location, threads=threads, limiter=limiter, **options)


def open_durable(cfg: Settings, *, upload_cap: bool = True, create: bool = True) -> StorageTier | None:
    """The durable tier named by resolved settings ``cfg`` (``durable`` and the S3 and transfer settings);
    None if unset. ``create``: see :func:`open_tier` (the inspection commands pass False: a mistyped
    ``--durable`` path is not made by ``ls``).

    ``upload_cap`` applies ``drain_bandwidth`` (the daemon); restore passes False: a job waiting to
    resume should not be throttled by a cap meant for background drains."""
    if not cfg.durable:
        return None
    scheme, _ = parse_url(cfg.durable)
    options: dict[str, Any] = {}
    if scheme == "s3":  # part size and attempts are range-checked by their settings' parsers
        options = {"endpoint_url": cfg.s3_endpoint_url, "region": cfg.s3_region, "part_size": cfg.s3_part_size,
                   "max_attempts": cfg.s3_max_attempts}
    tier = open_tier(cfg.durable, threads=cfg.drain_threads, bandwidth=cfg.drain_bandwidth if upload_cap else None,
                     create=create, **options)
    tier.compression = compression_for(cfg.durable_compression, scheme)
    return tier


def compression_for(setting: str, scheme: str) -> str:
    """What ``durable_compression`` means on a tier of ``scheme``: "zstd" or "off" (auto: zstd on S3, where
    the bytes are paid for and the network is slower than encoding; off on POSIX, see docs/benchmarks.md)."""
    if setting == "auto":
        return "zstd" if scheme == "s3" else "off"
    return setting


__all__ = ["open_durable", "open_tier", "parse_url", "register"]
