"""Straggler detection: each rank's own step time, compared with its peers' every window of steps.

In synchronous data-parallel training every rank waits for the slowest at each collective, so the wall
time between two ``ckpt.step()`` calls is the same on every rank: it cannot say which rank is slow. What
differs is how long each rank waits for the others. A rank's **own step time** is therefore:

* the wall time from the return of one ``ckpt.step()`` to the entry of the next (the program's own work;
  the time ranks spend inside ``step()``, where they wait for each other in rslurm's per-step agreement
  and copy a save, is left out),
* minus, for each ``DistributedDataParallel`` model in the state, the time its last sampled iteration
  waited for the gradient all-reduce after its backward computation ended (DDP's own runtime statistics,
  ``backward_comm_time - backward_compute_comm_overlap_time``; DDP samples iterations 1 to 10 and every
  100th, every ``window``-th when the window is shorter; a window in which DDP sampled no new iteration is
  not judged).

The slow rank waits least, so its own time stays long while its peers' shrink by the time they waited
for it. Waits inside collectives rslurm cannot see (the program's own all_reduce, FSDP's all-gathers) stay
in every rank's own time; a rank slow only before such a collective is then not told apart
(docs/launcher.md, Stragglers).

Who calls what, and when (the :class:`~resilient_slurm.checkpoint.checkpointer.Checkpointer` does all of
it, on every rank, when ``straggler_ratio`` is set and the job has more than one rank):

1. ``clock.entered(now)`` first thing in ``step()``, ``clock.left(now)`` when ``step()`` returns.
2. ``clock.report_due()`` at each agreement step: True on every rank alike once ``window`` steps were
   counted since the last report (a count of ``step()`` calls, the same on every rank).
3. Then ``clock.take(wait_s)`` gives this rank's median own step time over the window in microseconds; it
   goes into this rank's slot of the agreement's element-wise max, so every rank learns all of them.
4. Rank 0 passes them to :meth:`StragglerWatch.update`, which returns the ranks that became stragglers and
   those that stopped being ones; the Checkpointer writes the events (reporting.py) and
   :meth:`RankStragglers.record` the run's ``stragglers.json``
   (``rslurm status`` shows it).

A rank is slow in a window when its own step time is at least ``ratio`` times the median of its peers'
and longer by at least :data:`MIN_GAP_S`; it becomes a straggler after :data:`PATIENCE` such windows in a
row, and stops being one after as many windows in a row in which it was not slow. Medians and patience
make it persistent: the rank was slower in more than half of the steps of two windows running, and one
slow step (a garbage collection, a page fault storm) or one window that straddles a change does not
count. With DDP the wait subtracted is that of the window's one sampled iteration, not a median: a rank
held up in that one iteration looks slow in that window (docs/launcher.md, Stragglers, says what that
costs).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..rundir import STRAGGLERS_FILE, RunDir

# The Checkpointer's logger, as before this check left its module: a program's log filters keep working.
log = logging.getLogger("resilient_slurm.checkpoint.checkpointer")

#: Below this difference from its peers a rank is not called a straggler whatever the ratio (sub-millisecond
#: steps are noise, not a slow node).
MIN_GAP_S = 0.001
#: Windows in a row that must agree before a rank becomes a straggler, or stops being one.
PATIENCE = 2
STATUS_FILE = STRAGGLERS_FILE  # the name rundir.py gives it
STATUS_MAX_BYTES = 1 << 20


class StepClock:
    """This rank's own step times (see the module docstring)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._left: float | None = None
        self._entered: float | None = None
        self._samples: list[float] = []
        self._steps = 0

    def entered(self, now: float) -> None:
        self._steps += 1
        self._entered = now
        if self._left is not None:
            self._samples.append(now - self._left)

    def left(self, now: float) -> None:
        self._left = now

    def pause(self) -> None:
        """Forget the interval in progress (a restore, a section without steps: not a step's work)."""
        self._left = None

    def report_due(self) -> bool:
        return self._steps >= self.window

    def take(self, wait_s: float = 0.0) -> int:
        """The window's median own step time minus ``wait_s``, in whole microseconds (at least 1; 0 when no
        step was timed); starts the next window."""
        samples, self._samples, self._steps = self._samples, [], 0
        if not samples:
            return 0
        return max(1, round((statistics.median(samples) - max(0.0, wait_s)) * 1e6))


    def take_none(self) -> int:
        """Start the next window without a measurement (0: not judged)."""
        self._samples, self._steps = [], 0
        return 0


@dataclass(frozen=True)
class Straggler:
    """One rank slower than its peers in a window."""

    rank: int
    node: str
    step_time_s: float
    peer_median_s: float

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.peer_median_s if self.peer_median_s > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "step_time_s": round(self.step_time_s, 6),
                "peer_median_s": round(self.peer_median_s, 6), "ratio": round(self.ratio, 3)}

    def describe(self) -> str:
        return (f"rank {self.rank} on {self.node}: {self.ratio:.2f}x its peers' step time "
                f"({self.step_time_s * 1e3:.1f} ms against {self.peer_median_s * 1e3:.1f} ms)")


def judge(times_us: Sequence[int], ratio: float, nodes: Sequence[str]) -> list[Straggler]:
    """The stragglers among ranks with own step times ``times_us`` (index = rank; 0 = not measured)."""
    measured = [(r, t / 1e6) for r, t in enumerate(times_us) if t > 0]
    if len(measured) < 2:
        return []
    out = []
    values = [t for _, t in measured]
    for i, (rank, t) in enumerate(measured):
        peers = statistics.median(values[:i] + values[i + 1:])
        if t >= ratio * peers and t - peers >= MIN_GAP_S:
            node = nodes[rank] if rank < len(nodes) else "?"
            out.append(Straggler(rank, node, t, peers))
    return out


class StragglerWatch:
    """Rank 0's view over windows: which ranks are stragglers now, and what changed. A rank becomes one
    after :data:`PATIENCE` windows in a row in which :func:`judge` found it slow, and stops being one after
    as many windows in a row in which it was not (so a window that straddles a change, or one noisy window,
    changes nothing)."""

    def __init__(self, ratio: float, window: int, nodes: Sequence[str]) -> None:
        self.ratio = ratio
        self.window = window
        self.nodes = tuple(nodes)
        self.current: dict[int, Straggler] = {}
        self._slow: dict[int, int] = {}  # rank -> windows in a row judged slow
        self._fast: dict[int, int] = {}  # current straggler -> windows in a row not judged slow

    def update(self, times_us: Sequence[int]) -> tuple[list[Straggler], list[Straggler], list[int]]:
        """Take one window's times: ``(new stragglers, all current stragglers, ranks no longer slow)``."""
        if sum(1 for t in times_us if t > 0) < 2:  # a window without measurements changes nothing
            return [], [self.current[r] for r in sorted(self.current)], []
        slow = {s.rank: s for s in judge(times_us, self.ratio, self.nodes)}
        self._slow = {r: self._slow.get(r, 0) + 1 for r in slow}
        new = []
        for r, s in sorted(slow.items()):
            if r in self.current:
                self.current[r] = s
                self._fast.pop(r, None)
            elif self._slow[r] >= PATIENCE:
                self.current[r] = s
                new.append(s)
        cleared = []
        for r in sorted(self.current):
            if r not in slow:
                self._fast[r] = self._fast.get(r, 0) + 1
                if self._fast[r] >= PATIENCE:
                    del self.current[r], self._fast[r]
                    cleared.append(r)
        return new, [self.current[r] for r in sorted(self.current)], cleared


class RankStragglers:
    """One rank's part in straggler detection, as its Checkpointer runs it (steps 1 to 4 of the module
    docstring): the rank's :class:`StepClock`, its slot in the agreement, and on rank 0 the
    :class:`StragglerWatch` and the run's ``stragglers.json``. Events are the caller's (reporting.py)."""

    def __init__(self, ratio: float, window: int, rank: int, world: int, nodes: Sequence[str], run_dir: str,
                 job_id: str | None, restart_count: int) -> None:
        self.clock = StepClock(window)
        self.rank = rank
        self.world = world
        self.watch = StragglerWatch(ratio, window, nodes) if rank == 0 else None
        self._run_dir = run_dir
        self._job_id = job_id
        self._restart_count = restart_count
        self._recorded = False

    def slots(self, wait_s: float | None) -> list[int]:
        """This rank's own step time over the window (microseconds) in its slot, 0 in the others'; ``wait_s``:
        DDP's gradient wait over the window, None without a new DDP sample (the same on every rank: DDP's
        iterations are in step), and then the window is not judged."""
        slots = [0] * self.world
        slots[self.rank] = self.clock.take(wait_s) if wait_s is not None else self.clock.take_none()
        return slots

    def judge(self, times_us: Sequence[int]) -> tuple[list[Straggler], list[Straggler], list[int]]:
        """Rank 0, after a window: :meth:`StragglerWatch.update` of every rank's time."""
        assert self.watch is not None
        return self.watch.update(times_us)

    def record(self, step: int, current: Sequence[Straggler], changed: bool) -> None:
        """Rank 0, after :meth:`judge` and its events: the run's stragglers.json, when the stragglers changed
        or at the first window (which replaces an old run's record). Never raises."""
        assert self.watch is not None
        if changed or not self._recorded:
            self._recorded = True
            try:
                write_status(self._run_dir, step=step, window=self.watch.window, ratio=self.watch.ratio,
                             stragglers=current, job_id=self._job_id, restart_count=self._restart_count)
            except Exception as exc:  # a status line is not worth a training step
                log.warning("could not record stragglers in %s: %s", self._run_dir, exc)


def write_status(run_dir: str, *, step: int, window: int, ratio: float, stragglers: Sequence[Straggler],
                 job_id: str | None, restart_count: int) -> None:
    """Record the current stragglers for ``rslurm status`` (``<run dir>/stragglers.json``, atomically)."""
    from ..storage.fileio import atomic_write

    doc = {"version": 1, "at": time.time(), "step": step, "window": window, "ratio": ratio,
           "job_id": job_id, "restart_count": restart_count, "stragglers": [s.to_json() for s in stragglers]}
    atomic_write(RunDir.at(run_dir).stragglers, json.dumps(doc, sort_keys=True).encode(), root=os.path.dirname(os.path.abspath(run_dir)))


def read_status(run_dir: str) -> dict[str, Any] | None:
    """What :func:`write_status` recorded; None when nothing was (or it is not a file rslurm wrote: a link,
    a special file, oversized or malformed, which ``rslurm status`` then leaves out)."""
    from ..errors import ConfigError
    from ..paths import load_json, open_regular, valid_time

    path = RunDir.at(run_dir).stragglers
    try:
        fd = open_regular(path, os.O_RDONLY, where="the run directory", root=os.path.dirname(os.path.abspath(run_dir)))
    except Exception:  # missing, a link, a FIFO: nothing to show
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(STATUS_MAX_BYTES + 1)
    if len(data) > STATUS_MAX_BYTES:
        return None
    try:
        doc = load_json(data, source=path)
    except ConfigError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("stragglers"), list):
        return None
    rows = [s for s in doc["stragglers"] if isinstance(s, Mapping) and isinstance(s.get("rank"), int)
            and all(isinstance(s.get(k), (int, float)) and math.isfinite(s[k])
                    for k in ("step_time_s", "peer_median_s", "ratio"))]
    step = doc.get("step")
    at = doc.get("at")
    return {"step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "at": at if valid_time(at) else None,
            "stragglers": [dict(s, node=str(s.get("node", "?"))) for s in rows]}


__all__ = ["MIN_GAP_S", "PATIENCE", "STATUS_FILE", "RankStragglers", "StepClock", "Straggler", "StragglerWatch", "judge", "read_status",
           "write_status"]
