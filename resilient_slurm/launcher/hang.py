"""Hang detection: the launcher reads its node's rank heartbeats and decides when the job is hung.

Who calls what, and when (:class:`~resilient_slurm.launcher.launch.Launcher` does all of it):

1. ``HangWatch(socket_path, timeout=..., startup_timeout=...)`` before the ranks start.
2. ``watch.check(now)`` from the launcher's loop (it reads the heartbeats at most once a second):
   None while every rank moves, else a :class:`Hang` naming the ranks that stopped, their last step and
   the limit they passed.

A rank is judged by the limit of where it is:

* before its first ``step()`` (section ``startup``, which covers the restore): ``startup_timeout``,
  counted from when its Checkpointer was built;
* inside a section with its own limit (``ckpt.section("eval", timeout=...)``): that limit;
* otherwise the hang timeout: ``timeout`` when set, else adaptive, ``ADAPTIVE_FACTOR`` times the slowest
  step time seen in the last ``WINDOW`` steps (a step time is the time between two beats divided by the
  steps between them), never below ``ADAPTIVE_FLOOR_S``.

Only ranks on the launcher's node are seen. A hung collective stops every rank, and a rank stuck on its
own (a filesystem, a deadlock) stops its peers at their next collective, so the node's ranks stop too.
A rank whose record is gone ended on its own (the Checkpointer removes it when it closes).

3. On a verdict the launcher calls :func:`respond_to_hang`: it adds each stuck rank's process state to the
   verdict (:meth:`Hang.with_states`), reads the verdict together with the ranks' output
   (:func:`~.attribution.attribute_hang`), has every rank's stacks written (:func:`~.stacks.dump_rank_stacks`),
   records a ``hang`` event and tears the ranks down.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import psutil

from ..control.heartbeat import Heartbeat, read_heartbeats
from ..rundir import RunDir
from ..telemetry import Event
from .attribution import HangCause, attribute_hang, rank_outputs
from .context import LaunchContext, launch_log
from .policy import Reason
from .processes import Children
from .stacks import dump_rank_stacks
from .stopping import teardown

ADAPTIVE_FACTOR = 10.0
ADAPTIVE_FLOOR_S = 120.0
WINDOW = 50
READ_EVERY_S = 1.0
# Process states that say why a rank makes no progress (a SIGSTOP or a debugger, a filesystem that does not
# answer, a process that ended and was not reaped); "sleeping" and "running" say nothing.
TELLING_STATES = frozenset({"stopped", "tracing-stop", "disk-sleep", "zombie", "dead"})


@dataclass(frozen=True)
class Stuck:
    """One rank of a hang: past its limit, or half-way to it while another rank is past its own."""

    rank: int
    pid: int
    step: int          # -1: it never reached a step
    section: str       # "startup", the program's section, or ""
    idle_s: float      # seconds since its last beat (or since its section began)
    limit_s: float
    state: str | None = None  # its process's state at the verdict (psutil: "stopped", "disk-sleep", ...)

    @property
    def past(self) -> bool:
        """Whether it is past its own limit (else half-way to it)."""
        return self.idle_s > self.limit_s

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "pid": self.pid, "last_step": self.step, "section": self.section,
                "idle_s": round(self.idle_s, 3), "limit_s": round(self.limit_s, 3), "state": self.state}


@dataclass(frozen=True)
class Hang:
    """The launcher's verdict: these ranks stopped making progress."""

    stuck: tuple[Stuck, ...]
    ranks_seen: int

    def with_states(self, state_of: Callable[[int], str | None]) -> Hang:
        """The same verdict with each stuck rank's process state, ``state_of(pid)`` (None: not known)."""
        return replace(self, stuck=tuple(replace(s, state=state_of(s.pid)) for s in self.stuck))

    def describe(self) -> str:
        parts = []
        # The ranks past their limit first: the text (and the evidence made of it) is cut at 8.
        for s in sorted(self.stuck, key=lambda s: not s.past)[:8]:
            where = f"before its first step ({s.section})" if s.step < 0 else (
                f"after step {s.step}" + (f" in section {s.section!r}" if s.section else ""))
            state = f" (process {s.state})" if s.state in TELLING_STATES else ""
            past = ">" if s.past else "of"
            parts.append(f"rank {s.rank} {where}{state}, idle {s.idle_s:.0f} s {past} {s.limit_s:.0f} s")
        more = f"; and {len(self.stuck) - 8} more" if len(self.stuck) > 8 else ""
        return "; ".join(parts) + more


@dataclass
class _Track:
    last: Heartbeat
    times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))


class HangWatch:
    """Reads the heartbeats of one node's ranks and judges them (see the module docstring)."""

    def __init__(self, socket_path: str, *, timeout: float | None, startup_timeout: float) -> None:
        self.socket_path = socket_path
        self.timeout = timeout                # None: adaptive; inf: off
        self.startup_timeout = startup_timeout
        self._tracks: dict[int, _Track] = {}
        self._next_read = 0.0
        # (step, when it was reached) of the furthest step any rank of this node began in this run of the ranks: kept
        # after the rank's record is gone, for the `ranks_exited` event (how far the run got).
        self.furthest: tuple[int, float] | None = None

    @property
    def enabled(self) -> bool:
        return not (self.timeout is not None and math.isinf(self.timeout))

    def observe(self, beats: dict[int, Heartbeat]) -> None:
        """Take in a reading (``check`` reads for itself; tests feed this directly)."""
        for hb in beats.values():
            if hb.step >= 0 and (self.furthest is None or hb.step > self.furthest[0]):
                self.furthest = (hb.step, hb.reached_t)
        for rank, hb in beats.items():
            t = self._tracks.get(rank)
            if t is None or t.last.pid != hb.pid:
                self._tracks[rank] = _Track(hb)
                continue
            if hb.step > t.last.step >= 0 and hb.beat_t > t.last.beat_t:
                t.times.append((hb.beat_t - t.last.beat_t) / (hb.step - t.last.step))
            t.last = hb
        for rank in list(self._tracks):
            if rank not in beats:  # closed: the rank ended on its own
                del self._tracks[rank]

    def tracks(self) -> dict[int, _Track]:
        """The ranks seen, with their last record."""
        return dict(self._tracks)

    def step_limit(self) -> float:
        """The hang timeout now: the setting, or the adaptive one."""
        if self.timeout is not None:
            return self.timeout
        slowest = max((max(t.times) for t in self._tracks.values() if t.times), default=0.0)
        return max(ADAPTIVE_FLOOR_S, ADAPTIVE_FACTOR * slowest)

    def judge(self, now: float) -> Hang | None:
        """The verdict on what was last observed."""
        if not self.enabled or not self._tracks:
            return None
        step_limit = self.step_limit()
        idle: list[Stuck] = []
        for rank, t in sorted(self._tracks.items()):
            hb = t.last
            if hb.section == "startup":
                limit, since = self.startup_timeout, hb.section_t
            elif hb.section and hb.section_timeout > 0:
                limit, since = hb.section_timeout, hb.section_t
            else:
                limit, since = step_limit, hb.beat_t
            idle.append(Stuck(rank, hb.pid, hb.step, hb.section, now - since, limit))
        if not any(s.past for s in idle):
            return None
        # A hang holds every rank: one whose clock started later (a rank that began its start-up a second after
        # the others, and is the one that hangs) is named too once it is half-way to its own limit.
        return Hang(tuple(s for s in idle if s.idle_s > s.limit_s / 2), len(self._tracks))

    def check(self, now: float | None = None) -> Hang | None:
        """Read the heartbeats (at most once a second) and judge them (with hang detection off, only read
        them: :attr:`furthest` is the run's progress either way)."""
        now = time.time() if now is None else now
        if now < self._next_read:
            return None
        self._next_read = now + READ_EVERY_S
        self.observe(read_heartbeats(self.socket_path))
        return self.judge(now)


def respond_to_hang(ctx: LaunchContext, watch: HangWatch, hang: Hang, children: Children) -> tuple[Hang, HangCause]:
    """The job is hung: every rank's stacks to the run directory, a ``hang`` event, then teardown. The
    verdict is classed with what the ranks said up to now (:func:`~.attribution.attribute_hang`), read
    before the teardown, whose signals make the ranks print errors of their own. Returns the verdict with
    the stuck ranks' process states, and its cause."""
    hang = hang.with_states(_process_state)
    cause = attribute_hang(hang.describe(), rank_outputs(children))
    launch_log.error("hang: %s; writing every rank's Python stacks to %s, then tearing the ranks down",
                     hang.describe(), RunDir.at(ctx.run_dir).stacks)
    if cause.reason is not Reason.HANG:
        launch_log.error("the ranks' output before the hang says why: %s", cause.evidence)
    stacks = dump_rank_stacks(ctx, {r: t.last.pid for r, t in watch.tracks().items()})
    ctx.event(Event.HANG, ranks=[s.to_json() for s in hang.stuck], ranks_seen=hang.ranks_seen,
              timeout_s=watch.step_limit(), stacks=stacks, cause=cause.reason.value, evidence=cause.evidence)
    teardown(ctx, children, grace=ctx.cfg.term_grace)
    return hang, cause


def _process_state(pid: int) -> str | None:
    """A process's state as psutil names it ("stopped", "disk-sleep", "running", ...); None when it is gone
    or not on this node."""
    try:
        return str(psutil.Process(pid).status())
    except (psutil.Error, OSError):
        return None


__all__ = ["ADAPTIVE_FACTOR", "ADAPTIVE_FLOOR_S", "Hang", "HangWatch", "Stuck", "respond_to_hang"]
