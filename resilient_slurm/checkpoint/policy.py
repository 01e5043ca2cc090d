"""Small pure strategies: when to save (cadence) and which steps to keep (retention)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed steps plus every multiple of ``keep_every``.

    The newest step is always kept, whatever the settings.
    """

    keep_last: int = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 (the newest step is always kept), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every must be a positive number of steps or unset, got {self.keep_every}")

    def keep(self, steps: Iterable[int]) -> set[int]:
        """The steps to keep among ``steps``."""
        ordered = sorted(set(steps))
        kept = set(ordered[-self.keep_last :])
        if self.keep_every:
            kept |= {s for s in ordered if s % self.keep_every == 0}
        return kept

    def deletable(self, steps: Iterable[int], invalid: Iterable[int] = ()) -> list[int]:
        """The steps that may be deleted, oldest first.

        ``invalid`` steps (committed, but a manifest or metadata that fails its checks) never count
        toward ``keep_last``, so a broken newest step can never push the only valid one out. They are
        deletable only when older than the newest valid step kept (nothing restorable is lost, and no
        restore would choose them); newer ones stay for inspection (``rslurm verify``)."""
        bad = set(invalid)
        valid = sorted(set(steps) - bad)
        kept = self.keep(valid)
        newest = max(kept, default=None)
        out = [s for s in valid if s not in kept]
        if newest is not None:
            out += [s for s in bad if s < newest]
        return sorted(out)


@dataclass
class Cadence:
    """Save every ``every_steps`` steps and/or when ``every_seconds`` passed since the last save.

    ``clock`` is injected so tests need no sleeping.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    clock: Callable[[], float] = time.monotonic
    _last_time: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError(f"every_steps must be >= 1 or unset, got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ConfigError(f"every_seconds must be > 0 or unset, got {self.every_seconds}")
        self._last_time = self.clock()

    @property
    def time_based(self) -> bool:
        """True if the decision depends on the clock (so ranks must agree on it)."""
        return self.every_seconds is not None

    def due(self, step: int) -> bool:
        """Is a save due at ``step`` (steps completed)?"""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and self.clock() - self._last_time >= self.every_seconds

    def saved(self) -> None:
        """Record that a save was just taken (restarts the time window)."""
        self._last_time = self.clock()
