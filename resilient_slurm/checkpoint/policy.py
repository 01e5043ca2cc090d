"""Small pure strategies: when to save (cadence) and which steps to keep (retention)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed steps plus every multiple of ``keep_every``.

    The newest step is always kept, whatever the settings, and so is every tagged step (``protected``
    in :meth:`deletable`): tags keep steps beside what the policy keeps, they do not change it.
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

    def deletable(self, steps: Iterable[int], invalid: Iterable[int] = (),
                  protected: Iterable[int] = ()) -> list[int]:
        """The steps that may be deleted, oldest first.

        ``invalid`` steps (committed, but a manifest or metadata that fails its checks) never count
        toward ``keep_last``, so a broken newest step can never push the only valid one out. They are
        deletable only when older than the newest valid step kept (nothing restorable is lost, and no
        restore would choose them); newer ones stay for inspection (``rslurm verify``).

        ``protected`` steps (tagged) are never deletable, valid or not."""
        bad = set(invalid)
        valid = sorted(set(steps) - bad)
        kept = self.keep(valid)
        newest = max(kept, default=None)
        out = [s for s in valid if s not in kept]
        if newest is not None:
            out += [s for s in bad if s < newest]
        spared = set(protected)
        return sorted(s for s in out if s not in spared)


#: The default cadence (no every_steps / every_seconds): bounds of its interval, the failure interval it
#: plans for when none was observed or set, and how many times a save's background write the interval
#: must be at least (so the disk is busy with checkpoints at most half of the time, and a save never waits
#: for the previous one).
AUTO_MIN_S = 60.0
AUTO_MAX_S = 3600.0
AUTO_FAILURE_INTERVAL_S = 86400.0
AUTO_WRITE_FACTOR = 2.0
AUTO_HISTORY = 5


def daly_interval(cost_s: float, failure_interval_s: float) -> float:
    """Daly's first-order optimum checkpoint interval (J. T. Daly, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", FGCS 2006): ``sqrt(2 C M) - C`` for a save that costs ``C``
    seconds of training and a mean time ``M`` between failures; ``M`` when ``C >= M / 2``. Young's (1974)
    ``sqrt(2 C M)`` without the correction."""
    c, m = max(0.0, cost_s), failure_interval_s
    if c >= m / 2:
        return m
    return (2 * c * m) ** 0.5 - c


def auto_interval(stall_s: float, write_s: float, failure_interval_s: float) -> float:
    """The default cadence's interval: Daly's optimum for the training time a save costs (its stall: the
    copy to the staging buffer; the write runs in the background), at least :data:`AUTO_WRITE_FACTOR`
    times the background write, within [:data:`AUTO_MIN_S`, :data:`AUTO_MAX_S`]."""
    t = max(daly_interval(stall_s, failure_interval_s), AUTO_WRITE_FACTOR * max(0.0, write_s))
    return min(AUTO_MAX_S, max(AUTO_MIN_S, t))


@dataclass
class Cadence:
    """Save every ``every_steps`` steps and/or when ``every_seconds`` passed since the last save.

    With ``auto`` (neither is set, and the default cadence is on) it saves on a time cadence of its own:
    :data:`AUTO_MIN_S` after the start, then every :func:`auto_interval` of the median stall and
    background write of the last :data:`AUTO_HISTORY` interval saves (:meth:`observe`) and
    ``failure_interval`` (seconds; :data:`AUTO_FAILURE_INTERVAL_S` when None).

    ``clock`` is injected so tests need no sleeping.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    clock: Callable[[], float] = time.monotonic
    auto: bool = False
    failure_interval: float | None = None
    _last_time: float = field(default=0.0, init=False)
    _stalls: list[float] = field(default_factory=list, init=False)
    _writes: list[float] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError(f"every_steps must be >= 1 or unset, got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ConfigError(f"every_seconds must be > 0 or unset, got {self.every_seconds}")
        if self.auto:
            if self.every_steps is not None or self.every_seconds is not None:
                raise ConfigError("the default cadence applies only when every_steps and every_seconds are unset")
            self.every_seconds = AUTO_MIN_S
        self._last_time = self.clock()

    @property
    def time_based(self) -> bool:
        """True if the decision depends on the clock (so ranks must agree on it)."""
        return self.every_seconds is not None

    @property
    def planned_failure_interval(self) -> float:
        return self.failure_interval or AUTO_FAILURE_INTERVAL_S

    def due(self, step: int) -> bool:
        """Is a save due at ``step`` (steps completed)?"""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and self.clock() - self._last_time >= self.every_seconds

    def saved(self) -> None:
        """Record that a save was just taken (restarts the time window)."""
        self._last_time = self.clock()

    def observe(self, stall_s: float, write_s: float) -> float | None:
        """Take the costs of a finished interval save; with ``auto``, return the new interval (None when it
        is the same as before)."""
        if not self.auto:
            return None
        self._stalls = (self._stalls + [stall_s])[-AUTO_HISTORY:]
        self._writes = (self._writes + [write_s])[-AUTO_HISTORY:]
        new = auto_interval(_median(self._stalls), _median(self._writes), self.planned_failure_interval)
        if new == self.every_seconds:
            return None
        self.every_seconds = new
        return new

    def costs(self) -> tuple[float, float]:
        """The median stall and background write the interval was chosen from (0, 0 before any)."""
        return (_median(self._stalls), _median(self._writes)) if self._stalls else (0.0, 0.0)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return 0.0 if n == 0 else s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
