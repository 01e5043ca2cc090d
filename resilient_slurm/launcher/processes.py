"""The launcher's children: N local ranks, or one ``srun``; how they ended; tearing their trees down.

Who calls what, and when: the launcher builds :class:`LocalRanks` (``rslurm launch -n N``) or
:class:`SrunStep` (``rslurm launch -- srun ...``), calls ``start()``, then ``poll()`` in its loop
(True once every child exited), ``failures()`` while running (ranks known to have failed, to bound
how long the others may linger), ``signal_ranks()`` to reach ranks on this node, ``teardown()`` when
the ranks must go, and ``exits()`` at the end.

Every child's stderr passes through a thread that copies it to the launcher's stderr and keeps the
last 64 KiB, so the launcher can name where a failing rank's traceback points. For srun it also reads
srun's own per-task lines (``srun: error: n2: task 1: Killed``), which are the only report of how each
remote task ended.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import psutil

from ..control.orphan import LAUNCHER_PID_ENV
from .rank_env import srun_with_rank_env

log = logging.getLogger(__name__)

TAIL_BYTES = 64 << 10

# strsignal() text -> signal number, as srun prints task ends ("Killed", "Terminated", ...).
_BY_DESCRIPTION = {}
for _s in signal.Signals:
    _d = signal.strsignal(_s)
    if _d:
        _BY_DESCRIPTION[_d.lower()] = int(_s)
_BY_DESCRIPTION.setdefault("out of memory", int(signal.SIGKILL))  # srun's own wording for OOM kills

# "srun: error: n2: task 1: Killed", "srun: error: n1: tasks 0-1: Exited with exit code 3"
_TASK_END = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+?)\s*$")
_EXITED = re.compile(r"Exited with exit code (\d+)")


@dataclass(frozen=True)
class RankExit:
    """How one rank ended: ``exit_code`` (0..255) or ``signal`` (number), where known."""

    rank: int | None
    exit_code: int | None
    signal: int | None
    node: str | None = None
    oom: bool = False  # srun said "Out Of Memory" (its step's cgroup saw an OOM kill)

    @property
    def ok(self) -> bool:
        """Exited 0."""
        return self.exit_code == 0 and self.signal is None

    def describe(self, sent: Mapping[int, str] | None = None) -> str:
        """``rank 1 on n2 was killed by SIGKILL`` / ``rank 0 exited with code 3``; with ``sent`` (the signals
        the launcher itself sent the ranks, each with why), a rank that ended on one of them is not called
        killed: ``rank 0 ended on the SIGTERM the launcher forwarded (SIGTERM: preempted)``."""
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        where = f" on {self.node}" if self.node else ""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            if sent and self.by_launcher(sent):
                return f"{who}{where} ended on the {name} the launcher forwarded ({sent[self.signal]})"
            return f"{who}{where} was killed by {name}"
        return f"{who}{where} exited with code {self.exit_code}"

    def by_launcher(self, sent: Mapping[int, str] | None) -> bool:
        """Ended on a signal the launcher itself sent the ranks (``sent``), not on one from outside."""
        return bool(sent) and self.signal is not None and self.signal in (sent or {})


def parse_task_line(line: str) -> list[RankExit]:
    """The task ends that one ``srun: error: ...`` line reports (empty if it is not such a line)."""
    m = _TASK_END.search(line)
    if not m:
        return []
    ranks: list[int] = []
    for part in m["tasks"].split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            ranks.extend(range(int(lo), int(hi) + 1))
        elif part:
            ranks.append(int(part))
    what = m["what"]
    em = _EXITED.search(what)
    if em:
        return [RankExit(r, int(em.group(1)), None, m["node"]) for r in ranks]
    said = what.split(" (core dumped)")[0].strip().lower()
    sig = _BY_DESCRIPTION.get(said)
    if sig is None:
        return []  # another kind of srun error line, not a task end
    return [RankExit(r, None, sig, m["node"], oom=said == "out of memory") for r in ranks]


class StreamTail(threading.Thread):
    """Reads a child's pipe to its end as the bytes come, not line by line: a rank's progress bar (tqdm, the
    Trainer's) redraws with ``\\r`` and no ``\\n``, and a reader of lines would show nothing of it until the
    line ends, holding all of it in memory meanwhile.

    - ``sink`` (when given) gets whole lines and redraws: what was read up to its last ``\\n`` or ``\\r``,
      in one write, so that the lines of ranks sharing the launcher's stderr never mix mid-line. The rest
      waits for its end, at most ``HOLD_S`` seconds or ``LINE_MAX`` bytes, then goes as it is.
    - The last ``cap`` bytes are kept (:meth:`tail`).
    - ``on_line`` gets each line (``\\n``-ended, or the last one at the end of the pipe); of a line longer
      than ``LINE_MAX``, its end (at most ``LINE_MAX`` kept from before the read that ended it), where
      srun's message after a killed rank's progress bar is."""

    LINE_MAX = 64 << 10
    HOLD_S = 0.2

    def __init__(self, src: IO[bytes], *, cap: int, name: str, sink: IO[bytes] | None = None,
                 on_line: Callable[[bytes], None] | None = None) -> None:
        super().__init__(name=name, daemon=True)
        self._src = src
        self._sink = sink
        self._on_line = on_line
        self.cap = cap
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._held = bytearray()  # read, not yet given to the sink: a line's start
        self._line = bytearray()  # read, not yet given to on_line

    def run(self) -> None:
        fd = self._src.fileno()
        try:
            while True:
                if self._held and not select.select([fd], [], [], self.HOLD_S)[0]:
                    self._relay(bytes(self._held))  # a line's start that waited long enough: shown as it is
                    self._held.clear()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                self._take(chunk)
        except OSError:
            pass
        finally:
            if self._held:
                self._relay(bytes(self._held))
            if self._line and self._on_line is not None:
                self._on_line(bytes(self._line))
            self._src.close()

    def _take(self, chunk: bytes) -> None:
        with self._lock:
            self._buf += chunk
            if len(self._buf) > 2 * self.cap:
                del self._buf[:-self.cap]
        if self._sink is not None:
            self._held += chunk
            cut = max(self._held.rfind(b"\n"), self._held.rfind(b"\r")) + 1
            if cut == 0 and len(self._held) > self.LINE_MAX:
                cut = len(self._held)
            if cut:
                self._relay(bytes(self._held[:cut]))
                del self._held[:cut]
        if self._on_line is not None:
            self._line += chunk
            while (nl := self._line.find(b"\n")) >= 0:
                line = bytes(self._line[:nl + 1])
                del self._line[:nl + 1]
                self._on_line(line)
            if len(self._line) > self.LINE_MAX:
                del self._line[:-self.LINE_MAX]

    def _relay(self, data: bytes) -> None:
        assert self._sink is not None
        try:
            self._sink.write(data)
            self._sink.flush()
        except (OSError, ValueError):  # our stderr is gone; keep draining so the child never blocks
            pass

    def tail(self) -> str:
        """The last ``cap`` bytes read, decoded leniently (a program's bytes are not always UTF-8)."""
        with self._lock:
            return bytes(self._buf[-self.cap:]).decode(errors="replace")

    def text(self, wait: float) -> str:
        """:meth:`tail` once the pipe has ended, or after ``wait`` seconds."""
        self.join(wait)
        return self.tail()


class _Tee(StreamTail):
    """A child's stderr copied to ours, its last ``TAIL_BYTES`` kept, srun's task lines parsed."""

    def __init__(self, src: IO[bytes], sink: IO[bytes] | None, name: str, parse_tasks: bool) -> None:
        super().__init__(src, cap=TAIL_BYTES, name=name, sink=sink, on_line=self._parse if parse_tasks else None)
        self.task_exits: list[RankExit] = []

    def _parse(self, line: bytes) -> None:
        self.task_exits.extend(parse_task_line(line.decode(errors="replace")))


_PR_SET_PDEATHSIG = 1
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _LIBC = None


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child, before exec: get ``sig`` when the launcher dies (even by SIGKILL), so that a
    killed launcher never leaves ranks running unsupervised; a rank's Checkpointer turns that SIGTERM
    into an emergency save like any other."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent_by_sigint() -> None:
    """``preexec_fn`` for a job's local drain daemon: SIGINT (its stop signal) when the launcher dies."""
    _die_with_parent(signal.SIGINT)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_trees(pids: Sequence[int], grace: float, *, first: int = signal.SIGTERM) -> int:
    """Send ``first`` to each process tree rooted at ``pids``, SIGKILL what is left after ``grace``
    seconds; return how many processes needed the SIGKILL. Descendants are collected before any
    signal, so children that are re-parented when their parent dies are still reached."""
    procs: list[psutil.Process] = []
    for pid in pids:
        procs.extend(_tree(pid))
    for p in procs:
        try:
            p.send_signal(first)
            if first != signal.SIGKILL:  # a stopped process (SIGSTOP) takes the signal only once it runs
                p.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, grace)) if grace > 0 and first != signal.SIGKILL else ([], procs)
    killed = 0
    for p in alive:
        try:
            p.kill()
            killed += 1
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return killed


# After one rank failed on its own, how long the others may take to notice (a collective error) and exit
# before the launcher tears them down; and how long a rank stopped meanwhile (SIGSTOP: it cannot exit by
# itself, and the others wait for it in their collectives) is given before that happens at once.
PEER_EXIT_WAIT = 30.0
STOPPED_WAIT = 2.0


# The most one gap between two looks counts toward those waits: when the launcher itself was stopped (a job
# suspended with `scontrol suspend` stops every process of it, then resumes them all), the ranks were
# stopped too, and that time was not theirs to exit in.
LOOK_GAP = 1.0


class Lingering:
    """The ranks left after one failed on its own (:meth:`begin`): :meth:`over`, called at every look of the
    launcher's loop, says when to stop waiting for them, and why. The waits count the time seen between
    looks, each gap at most :data:`LOOK_GAP`."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the first failure was seen
        self._last = 0.0
        self._waited = 0.0
        self._stopped_for: float | None = None  # seen stopped for this long (None: not stopped at the last look)
        self._after = "a rank failed"  # what started the wait, for the messages

    def begin(self, children: Children, now: float, sent: Mapping[int, str] | None = None) -> list[RankExit]:
        """Start the wait; ``sent``: the signals the launcher itself sent the ranks (each with why), so that a
        rank that ended on one of them is said to have, and not to have been killed from outside."""
        self.since = self._last = now
        failures = list(children.failures())
        first = failures[0]
        if first.by_launcher(sent):
            self._after = "a rank ended on the signal the launcher forwarded"
            log.info("%s; the others get %.0f s to exit", first.describe(sent), PEER_EXIT_WAIT)
        else:
            log.warning("%s; the others get %.0f s to exit", first.describe(), PEER_EXIT_WAIT)
        return failures

    def over(self, children: Children, now: float) -> str | None:
        assert self.since is not None
        step = min(max(0.0, now - self._last), LOOK_GAP)
        self._last = now
        self._waited += step
        if self._waited >= PEER_EXIT_WAIT:
            return f"ranks still running {PEER_EXIT_WAIT:.0f} s after {self._after}"
        stopped = children.stopped_ranks()
        if not stopped:
            self._stopped_for = None
            return None
        self._stopped_for = 0.0 if self._stopped_for is None else self._stopped_for + step
        if self._stopped_for < STOPPED_WAIT:
            return None
        return (f"rank {', '.join(map(str, stopped))} stopped (SIGSTOP) after {self._after}: it cannot exit by "
                "itself and the others wait for it")


class Children:
    """Common part of the launcher's children (see the module docstring for the call order)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._tees: list[_Tee] = []
        self.torn_down = False
        self._left_early: dict[int, float] = {}  # (LocalRanks.left_early)

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str], name: str, parse_tasks: bool) -> None:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                # Own session: a Ctrl-C in the terminal reaches the launcher only, which
                                # turns it into an emergency save instead of a KeyboardInterrupt mid-step.
                                start_new_session=True, preexec_fn=_die_with_parent)
        assert proc.stderr is not None
        # No stderr (started with 2>&-): the ranks' output is still read, kept and parsed, not shown.
        tee = _Tee(proc.stderr, getattr(sys.stderr, "buffer", None), f"rslurm-tee:{name}", parse_tasks)
        tee.start()
        self._procs.append(proc)
        self._tees.append(tee)

    @property
    def pids(self) -> list[int]:
        """Pids of the direct children."""
        return [p.pid for p in self._procs]

    def poll(self) -> bool:
        """True once every child exited."""
        return all(p.poll() is not None for p in self._procs)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every child; True if all exited."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    @property
    def left_early(self) -> dict[int, float]:
        """Rank -> when it was seen to have exited 0 on its own (before any teardown) while another rank had
        not: the program ended there while it went on elsewhere, and a peer's collective then fails
        (outcome.py: left_early). Only :class:`LocalRanks` sees them (srun reports no task that exits 0)."""
        return dict(self._left_early)

    def teardown(self, grace: float) -> None:
        """Terminate every child's whole process tree: SIGTERM, then SIGKILL after ``grace`` s."""
        self.torn_down = True
        live = [p.pid for p in self._procs if p.poll() is None]
        if live:
            n = kill_trees(live, grace)
            log.warning("tore down %d child process tree(s)%s", len(live),
                        f"; {n} process(es) needed SIGKILL" if n else "")
        self.wait(10)

    def finish(self) -> None:
        """Kill what the exited children left in their process groups, then join the stderr threads."""
        for p in self._procs:
            # Every child leads its own process group (start_new_session=True): helpers it left behind
            # (a killed rank's DataLoader workers, a crashed rank's subprocesses) are still in it. They
            # would outlive the launcher, and hold the stderr pipe open so the relay never ends.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for t in self._tees:
            t.join(timeout=5)

    def stderr_tail(self, index: int = 0) -> str:
        """The last 64 KiB a child wrote to stderr."""
        return self._tees[index].tail() if index < len(self._tees) else ""

    def start(self) -> None:
        """Start the children."""
        raise NotImplementedError

    def failures(self) -> list[RankExit]:
        """Ranks known to have ended badly so far."""
        raise NotImplementedError

    def exits(self) -> list[RankExit]:
        """How each rank ended (after :meth:`poll` returned True)."""
        raise NotImplementedError

    def signal_ranks(self, sig: int) -> None:
        """Send ``sig`` to the ranks this launcher started directly (not to remote ones)."""
        raise NotImplementedError

    def stopped_ranks(self) -> list[int]:
        """The ranks alive here and stopped by SIGSTOP (none known for ranks under srun, on their nodes)."""
        return []


class LocalRanks(Children):
    """``nprocs`` ranks of ``argv`` on this machine, with torch.distributed variables set (unless
    ``dist_env`` is False: one plain process, e.g. a torchrun that sets them itself)."""

    def __init__(self, argv: Sequence[str], nprocs: int, env: Mapping[str, str], master_port: int, *,
                 dist_env: bool = True) -> None:
        super().__init__()
        self.argv = list(argv)
        self.nprocs = nprocs
        self.env = dict(env)
        self.master_port = master_port
        self.dist_env = dist_env

    def start(self) -> None:
        for r in range(self.nprocs):
            env = dict(self.env)
            # Ranks that lose this launcher bound themselves (control/orphan.py): they are its children, in
            # sessions of their own, on its host, so its pid names it for them.
            env[LAUNCHER_PID_ENV] = str(os.getpid())
            if self.dist_env:
                env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(self.nprocs),
                           LOCAL_WORLD_SIZE=str(self.nprocs), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(self.master_port))
            self._spawn(self.argv, env, f"rank{r}", parse_tasks=False)
        log.info("started %d local rank(s): %s", self.nprocs, " ".join(self.argv))

    def _exit_of(self, rank: int, code: int) -> RankExit:
        return RankExit(rank, None, -code) if code < 0 else RankExit(rank, code, None)

    def poll(self) -> bool:
        """True once every rank exited. Notes each rank seen to have exited 0 on its own (before any teardown)
        while another had not (:attr:`left_early`)."""
        codes = [p.poll() for p in self._procs]
        if not self.torn_down and any(c != 0 for c in codes):
            for r, c in enumerate(codes):
                if c == 0:
                    self._left_early.setdefault(r, time.time())
        return all(c is not None for c in codes)

    def failures(self) -> list[RankExit]:
        out = []
        for r, p in enumerate(self._procs):
            code = p.poll()
            if code is not None and code != 0:
                out.append(self._exit_of(r, code))
        return out

    def exits(self) -> list[RankExit]:
        return [self._exit_of(r, p.returncode if p.returncode is not None else -int(signal.SIGKILL))
                for r, p in enumerate(self._procs)]

    def stopped_ranks(self) -> list[int]:
        """The ranks alive and stopped (SIGSTOP, not a debugger's ptrace stop)."""
        out = []
        for r, p in enumerate(self._procs):
            try:
                if p.poll() is None and psutil.Process(p.pid).status() == psutil.STATUS_STOPPED:
                    out.append(r)
            except psutil.Error:
                pass
        return out

    def signal_ranks(self, sig: int) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def rank_stderr_tail(self, rank: int) -> str:
        """The last 64 KiB rank ``rank`` wrote to stderr."""
        return self.stderr_tail(rank)


class SrunStep(Children):
    """One ``srun ...`` job step: ranks on every node of the allocation. Every task gets torchrun's
    variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...) through a task prolog that
    :func:`~.rank_env.srun_with_rank_env` adds to ``argv``."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str],
                 node_addrs: Mapping[str, str | None] | None = None) -> None:
        super().__init__()
        # A pid means nothing on the other nodes; Slurm ends the job's steps when the launcher (the batch
        # script) ends.
        env = {k: v for k, v in env.items() if k != LAUNCHER_PID_ENV}
        self.argv, self.env = srun_with_rank_env(argv, env, node_addrs)

    def start(self) -> None:
        self._spawn(self.argv, self.env, "srun", parse_tasks=True)
        log.info("started job step: %s", " ".join(self.argv))

    @property
    def returncode(self) -> int | None:
        """srun's exit code (negative: killed by that signal), None while running."""
        return self._procs[0].poll() if self._procs else None

    def failures(self) -> list[RankExit]:
        return [e for e in self._tees[0].task_exits if not e.ok] if self._tees else []

    def exits(self) -> list[RankExit]:
        reported = self.failures()
        if reported:
            return reported
        rc = self.returncode
        if rc is None or rc == 0:
            return [RankExit(None, 0, None)]
        # srun ended badly without naming a task (killed itself, or could not launch).
        return [RankExit(None, None, -rc)] if rc < 0 else [RankExit(None, rc, None)]

    def signal_ranks(self, sig: int) -> None:
        # Tasks are children of slurmstepd, not of srun: only Slurm reaches them (SlurmClient.signal).
        return None
