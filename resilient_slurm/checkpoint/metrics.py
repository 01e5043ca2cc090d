"""Per-step metrics and the check that a resumed run trains the steps it repeats as it did before the stop.

``ckpt.step(step, state, metrics={"loss": loss})`` hands this module a few numbers per step and rank.
They are appended to the rank's metrics file in its node-local run directory::

    <local root>/<run_id>/metrics/rank<r>.jsonl     one line per step: {"step": 12, "world": 2, "m": {"loss": 2.5}}

Why a file of its own and not ``events.jsonl``: a line per step and rank would be most of the event log
(millions of lines on a long run), and a restore would have to parse all of it to find the steps it
repeats. Here a line is about 50 bytes, and a restore reads only the file's tail, backwards, down to the
restored step.

Why this is enough to catch a resume that is not exact: when a run stops after its newest checkpoint
(a rank killed, a node lost, a hang: anything without an emergency save), the resumed run trains the
steps ``restored + 1 .. last recorded`` again. A deterministic program must record the same values for
them. :func:`MetricsLog.resume` cuts those lines off the file (so the file always holds one value per
step: the run as it finally went) and returns them; :class:`ResumeCheck` compares them, step by step,
with what the resumed run records. The Checkpointer keeps both in a :class:`RankMetrics` and its reporter
(reporting.py) turns the verdict into a ``resume_verified`` or a ``resume_diverged`` event (docs/telemetry.md). ``rslurm rehearse`` reads the same files of two runs
(:func:`read_metrics`) to compare an interrupted run with one that never stopped.

Standard library only: ``rslurm rehearse`` reads these files without importing torch.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..paths import load_json, open_regular
from ..rundir import METRICS_DIR, RunDir

log = logging.getLogger(__name__)

_MAX_LINE = 64 << 10
MAX_METRICS = 32  # values per step: "small" metrics (a loss, a grad norm, a learning rate), not a histogram
MAX_NAME = 64
_FILE_RE = re.compile(r"^rank(\d+)\.jsonl$")
_CHUNK = 1 << 16

Number = int | float
Values = dict[str, Number]


def metrics_path(run_dir: str, rank: int) -> str:
    """The metrics file of ``rank`` in a node-local run directory."""
    return RunDir.at(run_dir).metrics_file(rank)


def check_metrics(step: int, metrics: Mapping[str, Any]) -> Values:
    """``metrics`` as plain numbers, or :class:`ConfigError` naming the step and the key at fault.

    A tensor or NumPy value of one element is taken with ``.item()`` (on a CUDA tensor that waits for the
    GPU: pass a number you already have on the CPU where that matters)."""
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"step {step}: metrics must be a dict of name -> number, got {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise ConfigError(f"step {step}: {len(metrics)} metrics; at most {MAX_METRICS} per step are recorded "
                          "(they are for checking a resume: a loss, a gradient norm, not every statistic)")
    out: Values = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key or len(key) > MAX_NAME:
            raise ConfigError(f"step {step}: metric name {key!r} must be a non-empty string of at most {MAX_NAME} "
                              "characters")
        out[key] = _number(step, key, value)
    return out


def _number(step: int, key: str, value: Any) -> Number:
    v = value
    if not isinstance(v, (int, float)) and callable(getattr(v, "item", None)):
        size = getattr(v, "numel", None)
        n = size() if callable(size) else getattr(v, "size", 1)
        if n != 1:
            raise ConfigError(f"step {step}: metric {key!r} has {n} elements; record a number (a tensor of one "
                              "element is read with .item())")
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"step {step}: metric {key!r} is {type(value).__name__} {value!r}; metrics are numbers")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"step {step}: metric {key!r} is {v}; metrics must be finite (a NaN loss is a "
                          "training problem a resume check cannot compare)")
    return v


@dataclass(frozen=True)
class Record:
    """One line of a metrics file."""

    step: int
    world: int
    values: Values


def _parse(line: bytes) -> Record | None:
    """A line as written by :meth:`MetricsLog.record`; None for a torn or foreign line."""
    try:
        d = load_json(line, source="metrics")
        step, world, values = d["step"], d["world"], d["m"]
    except (ConfigError, KeyError, TypeError, IndexError):
        return None
    if not (isinstance(step, int) and isinstance(world, int) and isinstance(values, dict)):
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
        return None
    return Record(step, world, values)


class MetricsLog:
    """One rank's metrics file: appended by :meth:`record` (one ``write(2)`` per step, no fsync: a
    crash may lose the last lines, which then are simply not compared), cut back by :meth:`resume`."""

    def __init__(self, run_dir: str, rank: int, world: int) -> None:
        self.path = metrics_path(run_dir, rank)
        self.root = os.path.dirname(os.path.abspath(run_dir))  # no link below it (the run dir, metrics/)
        self.world = world
        self._fd: int | None = None
        self._warned = False

    def resume(self, restored_step: int) -> dict[int, Record]:
        """Cut the lines of steps after ``restored_step`` off the file and return them (by step).

        The file is read backwards from its end, so a restore reads only what it repeats. Lines are in
        step order: each incarnation appends after the step it restored, and this cut runs first."""
        later: dict[int, Record] = {}
        try:
            fd = open_regular(self.path, os.O_RDWR, root=self.root)
        except FileNotFoundError:
            return later
        except Exception as exc:  # a link, a FIFO: nothing is compared, and nothing appended there
            self._warn(exc)
            return later
        try:
            end = os.fstat(fd).st_size
            pos, buf, checked = end, b"", 0
            while pos > 0:  # back to the first chunk that holds a whole line of a step <= restored_step
                n = min(max(_CHUNK, len(buf)), pos)  # doubling: linear in what is read
                pos -= n
                buf = os.pread(fd, n, pos) + buf
                whole = buf.split(b"\n")[1 if pos > 0 else 0:]  # the first piece may be a line's end
                fresh = whole[: len(whole) - checked]
                checked = len(whole)
                if any((r := _parse(line)) is not None and r.step <= restored_step for line in fresh):
                    break
            lines = buf.split(b"\n")
            offset = pos
            if pos > 0:
                offset += len(lines[0]) + 1
                lines = lines[1:]
            cut = offset
            found: list[Record] = []
            for line in lines:
                offset += len(line) + 1
                rec = _parse(line)
                if rec is None:
                    continue
                if rec.step <= restored_step:
                    cut, found = min(offset, end), []
                else:
                    found.append(rec)
            for rec in found:
                later.setdefault(rec.step, rec)
            if cut < end:
                os.ftruncate(fd, cut)
        except OSError as exc:
            self._warn(exc)
        finally:
            os.close(fd)
        return later

    def record(self, step: int, values: Values) -> None:
        """Append the values of ``step``; never raises (a failure is logged once, training goes on)."""
        line = (json.dumps({"step": step, "world": self.world, "m": values}, separators=(",", ":")) + "\n").encode()
        try:
            if self._fd is None:
                self._fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600, root=self.root,
                                        make_dirs=True)
            os.write(self._fd, line)
        except Exception as exc:
            self._warn(exc)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("cannot use the metrics file %s (%s); steps are not recorded or compared there", self.path,
                        exc)


def read_metrics(run_dir: str) -> dict[int, dict[int, Values]]:
    """Every rank's recorded values in a run directory: rank -> step -> values (the last line of a step
    wins). Torn lines are skipped; files that are not regular files are left out."""
    out: dict[int, dict[int, Values]] = {}
    d = RunDir.at(run_dir).metrics
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for name in sorted(names):
        m = _FILE_RE.match(name)
        if not m:
            continue
        try:
            fd = open_regular(os.path.join(d, name), os.O_RDONLY, root=os.path.dirname(os.path.abspath(run_dir)))
        except Exception:
            continue
        with os.fdopen(fd, "rb") as f:
            steps: dict[int, Values] = {}
            # A line is a few hundred bytes: a longer one (a damaged file, one without newlines) is read in
            # pieces that parse as nothing, never into memory whole.
            for line in iter(lambda: f.readline(_MAX_LINE), b""):
                rec = _parse(line)
                if rec is not None:
                    steps[rec.step] = rec.values
        out[int(m.group(1))] = steps
    return out


def same(a: Number | None, b: Number | None, tolerance: float) -> bool:
    """Whether two recorded values agree: equal when ``tolerance`` is 0, else within ``tolerance`` of the
    larger magnitude (relative). A value missing on one side never agrees."""
    if a is None or b is None:
        return False
    if tolerance == 0:
        return a == b
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


@dataclass(frozen=True)
class Divergence:
    """The first value a resumed run recorded differently."""

    step: int
    metric: str
    before: Number | None
    after: Number | None


def first_difference(step: int, before: Mapping[str, Number], after: Mapping[str, Number],
                     tolerance: float) -> Divergence | None:
    """The first metric (by name) of ``step`` whose values disagree; a metric on one side only disagrees."""
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if not same(a, b, tolerance):
            return Divergence(step, key, a, b)
    return None


class ResumeCheck:
    """Compares the steps a resumed rank trains again with what it recorded for them before the stop."""

    def __init__(self, restored_step: int, before: Mapping[int, Record], world: int, tolerance: float) -> None:
        # Values recorded with another number of ranks came from other data shards: not comparable.
        self.expected = {s: r.values for s, r in before.items() if r.world == world}
        self.restored_step = restored_step
        self.last_step = max(self.expected, default=restored_step)
        self.tolerance = tolerance
        self.compared: list[int] = []
        self.values = 0

    @property
    def pending(self) -> bool:
        return bool(self.expected)

    def observe(self, step: int, values: Mapping[str, Number]) -> Divergence | None:
        """Compare ``step`` if it was recorded before the stop; the first divergence ends the check."""
        before = self.expected.pop(step, None)
        if before is None:
            return None
        found = first_difference(step, before, values, self.tolerance)
        if found is not None:
            self.expected.clear()
            return found
        self.compared.append(step)
        self.values += len(before)
        return None

    def finished(self, step: int) -> bool:
        """True once ``step`` is past every step recorded before the stop."""
        return step >= self.last_step


@dataclass(frozen=True)
class ResumeOutcome:
    """How a resume check ended: ``divergence`` None when every compared step agreed (``resume_verified``)."""

    check: ResumeCheck
    divergence: Divergence | None = None


class RankMetrics:
    """One rank's metrics as its Checkpointer keeps them: the :class:`MetricsLog` and, after a restore, the
    :class:`ResumeCheck` of the steps trained again. Its outcomes go to the caller's reporter
    (reporting.py): this class writes no event."""

    def __init__(self, run_dir: str, rank: int, world: int, tolerance: float) -> None:
        self.log = MetricsLog(run_dir, rank, world)
        self.world = world
        self.tolerance = tolerance
        self.opened = False
        self.check: ResumeCheck | None = None

    def restored(self, restored: int) -> None:
        """After a restore: take the steps recorded after ``restored`` off this rank's metrics file; the
        resumed run must record the same values for them (a run that stopped after its newest checkpoint:
        a crash, a hang, a lost node)."""
        self.opened = True
        check = ResumeCheck(restored, self.log.resume(restored), self.world, self.tolerance)
        self.check = check if check.pending else None

    def record(self, step: int, values: Values | None) -> ResumeOutcome | None:
        """Record ``step``'s values (None: none given); the resume check's outcome when this step ended it."""
        if not self.opened and values is not None:
            self.opened = True
            self.log.resume(step - 1)  # no restore() in this program: its record starts over here
        if values is not None:
            self.log.record(step, values)
        check = self.check
        if check is None:
            return None
        found = check.observe(step, values or {})
        if found is not None:
            self.check = None
            return ResumeOutcome(check, found)
        if check.finished(step):
            self.check = None
            if check.compared:
                return ResumeOutcome(check)
        return None

    def close(self) -> ResumeOutcome | None:
        """Close the file; the resume check's outcome when the program stopped before every repeated step
        was trained (and some were compared)."""
        check, self.check = self.check, None
        outcome = ResumeOutcome(check) if check is not None and check.compared else None
        self.log.close()
        return outcome


__all__ = ["MAX_METRICS", "MAX_NAME", "METRICS_DIR", "Divergence", "MetricsLog", "RankMetrics", "Record", "ResumeCheck",
           "ResumeOutcome", "check_metrics", "first_difference", "metrics_path", "read_metrics", "same"]
