"""``rslurm rehearse``: find out before a long run whether its resume is exact.

    rslurm rehearse [-n N] [--steps K] [--kill] [--seed S] [--tolerance T] [--dir DIR] -- CMD ...

A program can lose work on a resume without any error: a batch fetched before ``ckpt.step()`` (nanoGPT's
loop), a random generator that is not in ``state``, a value a rank keeps for itself. The resumed run
then trains on other data than the run that never stopped, and nothing says so. The rehearsal runs the
program as the job would run it (``rslurm launch -n N -- CMD``, the real launcher, the real signals):

1. **uninterrupted**: once to the end, in a directory of its own;
2. **interrupted**: again in a fresh directory; when rank 0 has recorded a step chosen at random (seeded,
   printed) the launcher gets SIGTERM, as a preemption would: every rank saves an emergency checkpoint
   and the launcher exits 75;
3. **resumed**: the same command in the same directory resumes from that checkpoint and runs to the end.
   With ``--kill``, one rank, chosen at random, is SIGKILLed at a later random step (nothing is saved
   then); the launcher restarts the ranks from the newest checkpoint (an in-job restart) and the steps
   since that checkpoint are trained again. A launcher that exits 75 (no in-job restarts left) is run
   again, as a requeue would;
4. every metric every rank recorded (``ckpt.step(step, state, metrics=...)``, read from the runs'
   metrics files, :mod:`resilient_slurm.checkpoint.metrics`) at every step is compared between the two
   runs, equal or within ``--tolerance`` (default ``resume_tolerance``).

Exit codes: 0 every value reproduced; 1 a value differs (the first step, metric, ranks and both values
are printed with the likely causes), or the program did not survive the stop or the resume; 2 usage
errors, and a program that cannot be rehearsed (it fails on its own, records no metrics, or ends
before the stop).

``--steps K`` is passed to the program as ``RSLURM_REHEARSE_STEPS`` (read it to train fewer steps in a
rehearsal); without it the program runs as long as it does. Each run gets ``RSLURM_RUN_ID=rehearse``
and ``RSLURM_LOCAL_DIR`` under the rehearsal's directory; the durable tier is unset (a rehearsal never
writes into the real run's storage); other ``RSLURM_*`` settings are kept. Inside a Slurm allocation
(``sbatch --wrap "rslurm rehearse -n 4 -- python train.py"``) the ranks run on the node the rehearsal
runs on, in local mode: the Slurm variables are left out of their environment, so the launcher never
requeues or holds the allocation the rehearsal runs in.

Standard library and psutil only, like ``rslurm launch``: no torch import here.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import config
from .checkpoint.metrics import Values, read_metrics, same
from .errors import ConfigError
from .jobenv import JobEnv
from .paths import describe_path, load_json, open_regular
from .rundir import EVENTS_FILE
from .terminal import printable

RUN_ID = "rehearse"
STEPS_ENV = "RSLURM_REHEARSE_STEPS"
REQUEUE_EXIT = 75  # what `rslurm launch` exits with when the run should go on in another incarnation
EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE = 0, 1, 2
MAX_INCARNATIONS = 6  # launcher runs to finish the interrupted run after the stop (in-job restarts used up)
# Settings a rehearsal sets itself for every run; the user's value would mix the runs with the real one.
_OWN = ("RSLURM_RUN_ID", "RSLURM_LOCAL_DIR", "RSLURM_DURABLE", "RSLURM_CONTROL_SOCKET", STEPS_ENV)
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
              "MASTER_PORT")


class RehearsalError(Exception):
    """The rehearsal could not go on; ``code`` is the exit status (1: the program failed a stop or a
    resume; 2: it cannot be rehearsed as given)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _say(text: str = "") -> None:
    print(printable(text, newlines=True), flush=True)  # values read from the runs' files: never an escape


# ----------------------------------------------------------------------------------------------- a run
@dataclass
class Run:
    """One of the two runs: its directory, node-local root and launcher logs."""

    root: Path
    name: str
    launches: int = 0

    @property
    def local_dir(self) -> Path:
        return self.root / "local"

    @property
    def run_dir(self) -> Path:
        return self.local_dir / RUN_ID

    def metrics(self) -> dict[int, dict[int, Values]]:
        return read_metrics(str(self.run_dir))

    def last_step(self, rank: int = 0) -> int:
        """The newest step ``rank`` recorded (-1: none): the end of its metrics file."""
        path = self.run_dir / "metrics" / f"rank{rank}.jsonl"
        try:
            with os.fdopen(open_regular(str(path), os.O_RDONLY, root=str(self.local_dir)), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = f.read().splitlines()
        except (OSError, ConfigError):
            return -1
        for line in reversed(lines):
            try:
                return int(load_json(line, source=str(path))["step"])
            except (ConfigError, ValueError, KeyError, TypeError, IndexError):
                continue
        return -1

    def _restores(self) -> list[dict[str, Any]]:
        """Rank 0's ``restore`` events, in order."""
        out: list[dict[str, Any]] = []
        try:
            text = (self.run_dir / EVENTS_FILE).read_text(errors="replace")
        except OSError:
            return out
        for line in text.splitlines():
            try:
                e = load_json(line, source=EVENTS_FILE)
            except ConfigError:
                continue
            if isinstance(e, dict) and e.get("event") == "restore" and e.get("rank") == 0:
                out.append(e)
        return out

    def restored_steps(self) -> list[int]:
        """The steps the ranks resumed from, in order (rank 0's ``restore`` events)."""
        return [e["step"] for e in self._restores() if isinstance(e.get("step"), int)]

    def integration(self) -> str | None:
        """The rslurm integration the program trains through (``lightning``, ``hf``: rank 0's ``restore``
        events, from its provenance), None for a loop of its own."""
        return next((str(e["integration"]) for e in self._restores() if isinstance(e.get("integration"), str)), None)


@dataclass
class Rehearsal:
    """What the command line asked for, and how each run is started."""

    command: list[str]
    nprocs: int
    steps: int | None
    kill: bool
    seed: int
    tolerance: float
    timeout: float
    env: dict[str, str] = field(default_factory=dict)

    def launch_argv(self) -> list[str]:
        return [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", str(self.nprocs), "--", *self.command]

    def start(self, run: Run) -> tuple[subprocess.Popen[bytes], Path]:
        env = dict(self.env)
        env["RSLURM_RUN_ID"] = RUN_ID
        env["RSLURM_LOCAL_DIR"] = str(run.local_dir)
        if self.steps is not None:
            env[STEPS_ENV] = str(self.steps)
        run.launches += 1
        logf = run.root / f"launch.{run.launches}.log"
        with open(logf, "ab") as f:
            proc = subprocess.Popen(self.launch_argv(), env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        return proc, logf

    def wait(self, proc: subprocess.Popen[bytes], what: str, logf: Path) -> int:
        try:
            return proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)  # a second Ctrl-C tears the ranks down at once
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RehearsalError(f"{what} did not finish within {self.timeout:.0f} s (--timeout); its log: {logf}",
                                 EXIT_USAGE) from None


def run_env(base: Mapping[str, str]) -> dict[str, str]:
    """The runs' environment: ``base`` without Slurm's and torch.distributed's variables (the ranks are
    local ranks of this node, even inside an allocation) and without the settings a rehearsal sets."""
    env = {k: v for k, v in base.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_")) and k not in _RANK_VARS
           and k not in _OWN}
    here = str(Path(__file__).resolve().parents[1])  # this package, importable by the launcher and ranks
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _tail(logf: Path, lines: int = 20) -> str:
    try:
        return "\n".join(logf.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_for_step(run: Run, proc: subprocess.Popen[bytes], step: int, timeout: float) -> bool:
    """Wait until rank 0 recorded ``step``; False when the run ended first."""
    deadline = time.monotonic() + timeout
    while run.last_step(0) < step:
        if proc.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise RehearsalError(f"the {run.name} run did not reach step {step} within {timeout:.0f} s", EXIT_USAGE)
        time.sleep(0.005)
    return True


def _rank_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The launcher's rank processes (its children; each leads its own session)."""
    import psutil

    try:
        return sorted(c.pid for c in psutil.Process(proc.pid).children(recursive=False))
    except psutil.Error:
        return []


# ------------------------------------------------------------------------------------------ comparison
@dataclass(frozen=True)
class Difference:
    rank: int
    step: int
    metric: str
    uninterrupted: float | int | None
    resumed: float | int | None


@dataclass
class Comparison:
    """Every value of every rank at every step, uninterrupted against interrupted and resumed."""

    ranks: int = 0
    steps: int = 0
    values: int = 0
    first_step: int | None = None
    differences: list[Difference] = field(default_factory=list)  # at first_step, one per diverging rank

    @property
    def identical(self) -> bool:
        return self.first_step is None


def compare(ref: Mapping[int, Mapping[int, Values]], got: Mapping[int, Mapping[int, Values]],
            tolerance: float) -> Comparison:
    """Compare two runs' metrics (rank -> step -> values); a step or metric on one side only differs."""
    out = Comparison(ranks=len(set(ref) | set(got)))
    firsts: dict[int, Difference] = {}
    all_steps: set[int] = set()
    for rank in sorted(set(ref) | set(got)):
        a, b = ref.get(rank, {}), got.get(rank, {})
        for step in sorted(set(a) | set(b)):
            all_steps.add(step)
            va, vb = a.get(step, {}), b.get(step, {})
            for key in sorted(set(va) | set(vb)):
                x, y = va.get(key), vb.get(key)
                out.values += 1
                if not same(x, y, tolerance):
                    firsts[rank] = Difference(rank, step, key, x, y)
                    break
            if rank in firsts:
                break
    out.steps = len(all_steps)
    if firsts:
        out.first_step = min(d.step for d in firsts.values())
        out.differences = [d for d in firsts.values() if d.step == out.first_step]
    return out


# The loops rslurm's integrations drive (provenance's ``integration``), as rehearse's advice names them.
INTEGRATION_LOOPS = {"lightning": "Lightning's", "hf": "the Trainer's (or Accelerate's)"}


def likely_causes(cmp: Comparison, restored: Sequence[int], ranks: int, integration: str | None = None) -> list[str]:
    """What most often makes a resume differ there: read from where and on which ranks it first differs, and
    through which integration the program trains (None: a loop of its own)."""
    assert cmp.first_step is not None
    step = cmp.first_step
    diverging = sorted(d.rank for d in cmp.differences)
    some = len(diverging) < ranks
    if not restored or step <= min(restored):
        return [f"the runs differ at step {step}, before any resume: the program is not deterministic (seeds "
                "from the clock or the pid, data order from the filesystem, non-deterministic kernels). A resume "
                "cannot be exact then; set --tolerance (resume_tolerance) to what such runs differ by"]
    causes: list[str] = []
    if step - 1 in restored:
        who = f"only on rank{'s' if len(diverging) > 1 else ''} {', '.join(map(str, diverging))}" if some else \
            "on every rank"
        if some:
            causes.append(f"per-rank state that is not in state ({who}, at the first step after the resume from "
                          f"step {step - 1}): a value each rank keeps for itself (a data cursor, a counter, a "
                          "generator) that the checkpoint does not hold; put it in state (one key, the same on "
                          "every rank: each rank's value is saved and restored to it)")
        if integration is not None:  # the integration saves at the framework's step boundary: no lost prefetch
            loop = INTEGRATION_LOOPS.get(integration, f"the {integration} integration's")
            causes.append(f"{loop} loop ({who}, at the first step after the resume from step {step - 1}): one of "
                          "the integration's documented exceptions (docs/integration.md: random draws while a batch is "
                          "read that it cannot follow, in DataLoader workers or a streamed dataset, a dataset read a "
                          "second time), or a defect of the "
                          "integration to report with this rehearsal's command")
        else:
            causes.append(f"a batch fetched before ckpt.step() ({who}, at the first step after the resume from step "
                          f"{step - 1}): a loop that prefetches the next batch before the step is saved (nanoGPT's) "
                          "loses that batch with the stop; fetch it after ckpt.step(), or save the data position "
                          "before the prefetch (docs/integration.md, Prefetching loops)")
        causes.append("randomness from a generator that is not in state (a random.Random(), a NumPy Generator or a "
                      "torch.Generator of your own): rslurm restores the global Python, NumPy and torch streams "
                      "only; put your generator in state")
        if not some:
            causes.append("a value that changes during training kept outside state (a counter, a curriculum "
                          "position, an EMA)")
    else:
        causes.append(f"not at the first step after a resume (resumed from step{'s' if len(restored) > 1 else ''} "
                      f"{', '.join(map(str, restored))}; the steps after agreed): a value kept outside state that "
                      "matters only later (a counter read every few steps, a schedule, a loader rebuilt at an "
                      "epoch boundary)")
        causes.append("non-deterministic kernels or reductions: then set --tolerance (resume_tolerance)")
        if some:
            causes.append(f"per-rank state not in state: only rank{'s' if len(diverging) > 1 else ''} "
                          f"{', '.join(map(str, diverging))} differ at step {step}")
    return causes


# ------------------------------------------------------------------------------------------ the rehearsal
def rehearse(r: Rehearsal, root: Path) -> int:
    """The three runs and the comparison; the exit status."""
    straight, stopped = Run(root / "uninterrupted", "uninterrupted"), Run(root / "interrupted", "interrupted")
    for run in (straight, stopped):
        run.root.mkdir(parents=True)
    rng = random.Random(r.seed)
    _say(f"rslurm rehearse: {r.nprocs} rank{'s' if r.nprocs > 1 else ''}, seed {r.seed}"
         f"{', --kill' if r.kill else ''}; runs in {root}")
    _say(f"  $ {shlex.join(r.launch_argv())}")

    _say("[1/3] uninterrupted run")
    proc, logf = r.start(straight)
    code = r.wait(proc, "the uninterrupted run", logf)
    if code != 0:
        raise RehearsalError(f"the uninterrupted run exited {code} (it must run to the end with exit 0 to be "
                             f"rehearsed); its log ({logf}):\n{_tail(logf)}", EXIT_USAGE)
    ref = straight.metrics()
    last = max((max(steps, default=-1) for steps in ref.values()), default=-1)
    if last < 0:
        raise RehearsalError("the program recorded no metrics: pass them at every step, "
                             "ckpt.step(step, state, metrics={\"loss\": loss.item()}) (docs/integration.md)",
                             EXIT_USAGE)
    if last < 3:
        raise RehearsalError(f"the program ran {last} step(s); a rehearsal needs at least 3 (--steps)", EXIT_USAGE)
    _say(f"      {last} steps, {len(ref)} rank{'s' if len(ref) > 1 else ''} recorded metrics")

    stop_at = rng.randint(1, max(1, (last - 1) // 2) if r.kill else last - 1)
    _say(f"[2/3] interrupted run: SIGTERM to the launcher after step {stop_at} (as a preemption would)")
    proc, logf = r.start(stopped)
    try:
        reached = _wait_for_step(stopped, proc, stop_at, r.timeout)
        if reached:
            proc.send_signal(signal.SIGTERM)
        code = r.wait(proc, "the interrupted run", logf)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code == 0:
        raise RehearsalError(f"the interrupted run finished before the stop took effect (its steps are too short "
                             f"to stop one in the middle); run more or slower steps (--steps); log: {logf}",
                             EXIT_USAGE)
    if code != REQUEUE_EXIT:
        raise RehearsalError(f"the program did not stop with an emergency checkpoint: `rslurm launch` exited {code}, "
                             f"not {REQUEUE_EXIT} (does every rank call ckpt.step() and leave its loop when "
                             f"ckpt.should_stop is set?); its log ({logf}):\n{_tail(logf)}", EXIT_DIFFERENT)
    stopped_after = stopped.last_step(0)
    _say(f"      stopped after step {stopped_after}; launcher exit {REQUEUE_EXIT}")

    kill_at: int | None = None
    if r.kill:
        if stopped_after + 1 <= last - 1:
            kill_at = rng.randint(stopped_after + 1, last - 1)
        else:
            _say(f"      (no step left between {stopped_after} and the end for --kill: no SIGKILL)")
    _say("[3/3] resumed run" + (f": SIGKILL to one rank after step {kill_at}" if kill_at is not None else ""))
    for _ in range(MAX_INCARNATIONS):
        proc, logf = r.start(stopped)
        try:
            if kill_at is not None and _wait_for_step(stopped, proc, kill_at, r.timeout):
                pids = _rank_pids(proc)
                if pids:
                    victim = rng.choice(pids)
                    try:
                        os.killpg(victim, signal.SIGKILL)  # each rank leads its own session: with its workers
                    except ProcessLookupError:
                        pass
                    _say(f"      SIGKILL to rank process {victim} at step {stopped.last_step(0)}")
                kill_at = None
            code = r.wait(proc, "the resumed run", logf)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if code != REQUEUE_EXIT:
            break
        _say(f"      launcher exit {REQUEUE_EXIT}: run again (as a requeue would)")
    if code != 0:
        raise RehearsalError(f"the resumed run failed: `rslurm launch` exited {code}; its log ({logf}):\n"
                             f"{_tail(logf)}", EXIT_DIFFERENT)
    restored = stopped.restored_steps()
    _say(f"      resumed from step{'s' if len(restored) > 1 else ''} {', '.join(map(str, restored)) or '(none)'}, "
         f"finished step {stopped.last_step(0)}")

    cmp = compare(ref, stopped.metrics(), r.tolerance)
    how = "equal" if r.tolerance == 0 else f"within a relative {r.tolerance:g}"
    if cmp.identical:
        _say(f"PASS: the interrupted and resumed run reproduced every metric of the uninterrupted run ({how}): "
             f"{cmp.values} values, {cmp.steps} steps, {cmp.ranks} rank{'s' if cmp.ranks > 1 else ''}")
        return EXIT_OK
    _say(f"FAIL: the interrupted and resumed run first differs from the uninterrupted run at step {cmp.first_step}"
         f" ({how} expected)")
    for d in cmp.differences:
        _say(f"  rank {d.rank}: {d.metric} = {d.uninterrupted!r} uninterrupted, {d.resumed!r} interrupted and "
             "resumed")
    _say("likely causes:")
    for cause in likely_causes(cmp, restored, max(cmp.ranks, r.nprocs), stopped.integration()):
        _say(f"  - {cause}")
    return EXIT_DIFFERENT


def cmd_rehearse(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("rehearse: no command; usage: rslurm rehearse [-n N] [--steps K] [--kill] -- CMD ...")
    if args.nprocs < 1:
        raise ConfigError(f"rehearse: -n must be >= 1, got {args.nprocs}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"rehearse: --timeout must be a number of seconds > 0, got {args.timeout:g}")
    if args.steps is not None and args.steps < 3:
        raise ConfigError(f"rehearse: --steps must be >= 3, got {args.steps}")
    if args.tolerance is not None:
        try:
            tolerance = config.SETTINGS["resume_tolerance"].parse(args.tolerance)
        except ValueError as exc:
            raise ConfigError(f"rehearse: --tolerance={args.tolerance!r}: {exc}") from exc
    else:
        tolerance = config.resolve(["resume_tolerance"], {}, config_path=args.config)["resume_tolerance"]
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    r = Rehearsal(command, args.nprocs, args.steps, args.kill, seed, float(tolerance), args.timeout,
                  env=run_env(os.environ))
    keep = args.dir is not None
    if keep:
        root = Path(args.dir).resolve()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"rehearse: --dir {root} is {describe_path(str(root))}, not a directory; give a new or "
                              "empty directory")
        if root.exists() and any(root.iterdir()):
            raise ConfigError(f"rehearse: --dir {root} is not empty; give a new or empty directory")
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"rehearse: --dir {root}: cannot make it ({exc.strerror}); give a new or empty "
                              "directory") from None
    else:
        root = Path(tempfile.mkdtemp(prefix="rslurm-rehearse-"))
    job_id = JobEnv.from_env(os.environ, warn=False).job_id
    if job_id:
        _say(f"inside Slurm job {job_id}: the ranks run on this node (rslurm launch -n "
             f"{args.nprocs}), outside Slurm's steps, so that nothing requeues this job")
    ok = False
    try:
        code = rehearse(r, root)
        ok = code == EXIT_OK
        return code
    except RehearsalError as exc:
        print(f"rslurm rehearse: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if ok and not keep:
            shutil.rmtree(root, ignore_errors=True)
        elif not ok:
            _say(f"the runs' directories are kept in {root}")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``rslurm rehearse`` on the CLI's sub-parsers (called by :func:`resilient_slurm.cli.build_parser`)."""
    sp: argparse.ArgumentParser = sub.add_parser(
        "rehearse", help="run the program uninterrupted, then stopped and resumed, and compare every recorded "
        "metric (is the resume exact?)",
        description="Run CMD under `rslurm launch -n N` to the end; run it again, stop it with an emergency "
        "checkpoint at a random step (SIGTERM to the launcher) and, with --kill, SIGKILL a rank at a later one; "
        "resume it, and compare every metric each rank recorded with ckpt.step(..., metrics=...) at every step. "
        "Exit codes: 0 identical, 1 a value differs (first step, ranks, both values and the likely causes are "
        "printed) or the program failed the stop or the resume, 2 usage errors or a program that cannot be "
        "rehearsed. docs/cli.md, rslurm rehearse.",
        usage="rslurm rehearse [-n N] [--steps K] [--kill] [--seed S] [--tolerance T] [--dir DIR] -- CMD ...")
    sp.add_argument("-n", "--nprocs", type=int, default=1, help="local ranks (rslurm launch -n N; default 1)")
    sp.add_argument("--steps", type=int, default=None, metavar="K",
                    help=f"steps the program should train, passed as ${STEPS_ENV} (the program reads it); default: "
                    "the program decides")
    sp.add_argument("--kill", action="store_true",
                    help="also SIGKILL a random rank at a random step after the resume: the steps since the newest "
                    "checkpoint are trained again")
    sp.add_argument("--seed", type=int, default=None, help="seed of the random stop steps (default: random, printed)")
    sp.add_argument("--tolerance", default=None, metavar="T",
                    help="relative difference allowed between the runs' values (default: resume_tolerance, 0 = "
                    "equal)")
    sp.add_argument("--dir", default=None, help="keep the runs here (a new or empty directory); default: a temporary "
                    "directory, removed when the rehearsal passes")
    sp.add_argument("--timeout", type=float, default=1800.0, help="seconds each run may take (default 1800)")
    sp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    sp.set_defaults(func=cmd_rehearse)
    return sp


__all__ = ["EXIT_DIFFERENT", "EXIT_OK", "EXIT_USAGE", "STEPS_ENV", "Comparison", "Difference", "add_parser",
           "cmd_rehearse", "compare", "likely_causes", "rehearse", "run_env"]
