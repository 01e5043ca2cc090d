"""The README demo: a tiny transformer trained under ``rslurm launch``, stopped mid-run, resumed, and
bitwise identical to a run that never stopped.

    python -m resilient_slurm.examples.demo [--ranks 2] [--steps 200] [--every-steps 25] [--out demo-output]
                                            [--kill] [--at STEP]
    python -m resilient_slurm.examples.demo --slurm [--partition P] [--nodes N] [--sbatch-arg=ARG ...]

The program is ``resilient_slurm.examples.train_tiny_lm``: a character-level decoder-only transformer
(dropout, AdamW, warmup + cosine LR, gradient clipping, a shuffled resumable sampler over DataLoader
workers, DDP over gloo) on a corpus it generates from a fixed seed. Local mode (the default, no
cluster needed) runs the same command three times:

1. ``rslurm launch -n R -- python -m resilient_slurm.examples.train_tiny_lm ...``: the reference,
   never interrupted;
2. the same command in a fresh directory; at a random step between two interval checkpoints the
   demo sends the launcher SIGTERM (as a preemption would). Every rank saves the same step (the
   emergency checkpoint) and the launcher exits 75 (EX_TEMPFAIL: "requeue me"). With ``--kill`` the
   ranks are SIGKILLed instead (the OOM killer, a dying node): nothing is saved at that moment;
3. the same command once more: it resumes from the newest committed step;
4. every step's loss, the final weights and the AdamW moments of the two runs are compared bit for
   bit; a loss-curve PNG (``<out>/loss_curve.png``) shows both runs and where the stop happened.

``--slurm`` does the same through a Slurm cluster: the reference and the training job are batch jobs
(``#SBATCH --requeue --signal=B:USR1@<grace> --open-mode=append``, ``exec rslurm launch -- srun
python -m ...``); the demo sends the training job's batch shell USR1 (``scancel --signal=USR1 --batch``,
what ``--signal`` delivers before the time limit), the launcher saves and requeues the job, Slurm
starts it again and it resumes. Without a cluster that answers, it says so and exits 2.

Evidence comes from the checkpoint manifests (``<run>/nvme/<node>/tiny-lm/step_*/manifest.json``; the
one committed at the stop is copied to ``<run>/stop-checkpoint.<node>.manifest.json`` before retention
removes it) and the program's own step logs (``<run>/log.<rank>.jsonl``), not from launcher internals.
Exit status: 0 identical, 1 different (or a run failed), 2 the demo cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ResilientSlurmError
from ..manifest import MANIFEST_NAME, Manifest, read_manifest_file

if TYPE_CHECKING:
    from ..slurm import CliSlurmClient, JobInfo

PROGRAM = "resilient_slurm.examples.train_tiny_lm"
RUN_ID = "tiny-lm"
REQUEUE_EXIT = 75  # EX_TEMPFAIL: what `rslurm launch` exits with when the job should run again
# Variables of the user's environment the runs keep: where control sockets live, how loud rslurm is.
# Every other RSLURM_* setting (a durable tier, a cadence...) would change what the demo shows.
KEPT_RSLURM = ("RSLURM_CONTROL_DIR", "RSLURM_LOG_LEVEL")


class DemoFailed(Exception):
    """A run did not behave as the demo expects; the message says which and where its log is."""


# --------------------------------------------------------------------------------------- a run's files
@dataclass
class Incarnation:
    """One start of the program, as its rank-0 log shows it."""

    start_step: int
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    exit: dict[str, Any] | None = None
    restart_count: int = 0


@dataclass
class Run:
    """One training run's directory: step logs, final states, node-local checkpoints."""

    root: Path
    ranks: int

    def log(self, rank: int) -> Path:
        return self.root / f"log.{rank}.jsonl"

    def final(self, rank: int) -> Path:
        return self.root / f"final.{rank}.pt"

    @property
    def local_dir(self) -> str:
        return str(self.root / "nvme" / "%n")

    def program_args(self, args: argparse.Namespace) -> list[str]:
        return ["--steps", str(args.steps), "--every-steps", str(args.every_steps),
                "--log", str(self.root / "log.%r.jsonl"), "--out", str(self.root / "final.%r.pt")]

    def incarnations(self, rank: int = 0) -> list[Incarnation]:
        """The program's starts, steps and exits, in order (a torn last line from a SIGKILL is skipped)."""
        out: list[Incarnation] = []
        path = self.log(rank)
        if not path.exists():
            return out
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "start":
                out.append(Incarnation(int(e["step"]), restart_count=int(e.get("restart_count", 0))))
            elif e.get("event") == "exit" and out:
                out[-1].exit = e
            elif "loss" in e and out:
                out[-1].steps[int(e["step"])] = e
        return out

    def last_step(self, rank: int = 0) -> int:
        incs = self.incarnations(rank)
        return max((s for inc in incs for s in inc.steps), default=0)

    def losses(self, rank: int) -> dict[int, tuple[float, list[int]]]:
        """Each step's (loss, batch) as the run finally has it; a step done twice must repeat itself."""
        seen: dict[int, tuple[float, list[int]]] = {}
        for inc in self.incarnations(rank):
            for s, e in inc.steps.items():
                now = (e["loss"], e["batch"])
                if s in seen and seen[s] != now:
                    raise DemoFailed(f"{self.log(rank)}: step {s} was redone after the restart with another "
                                     f"result ({seen[s][0]!r} then {now[0]!r})")
                seen[s] = now
        return seen

    def manifests(self) -> list[tuple[Path, Manifest]]:
        """Committed steps in every node's local directory, oldest first."""
        found = []
        for path in sorted((self.root / "nvme").glob(f"*/{RUN_ID}/step_*/{MANIFEST_NAME}")):
            try:
                found.append((path, read_manifest_file(str(path))))
            except (OSError, ResilientSlurmError):
                continue  # a step being written or damaged is not evidence of anything
        return sorted(found, key=lambda pm: (pm[1].step, str(pm[0])))


# --------------------------------------------------------------------------------------- printing
def _say(text: str = "") -> None:
    print(text, flush=True)


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 * 2**20 else f"{n / 2**20:,.1f} MiB"


def _cmd_text(argv: Sequence[str]) -> str:
    """A command as the user would type it: ``python`` and ``rslurm`` instead of full paths."""
    shown = []
    for a in argv:
        if a == sys.executable:
            a = "python"
        shown.append(a)
    text = shlex.join(shown)
    return text.replace("python -m resilient_slurm.cli ", "rslurm ")


def _describe_checkpoint(run: Run, step: int) -> Manifest:
    ms = [(p, m) for p, m in run.manifests() if m.step == step]
    if not ms:
        raise DemoFailed(f"no committed manifest for step {step} under {run.root / 'nvme'}")
    path, m = ms[0]
    per_rank = ", ".join(f"rank {s.rank} {_kib(s.size)}" for s in sorted(m.shards, key=lambda s: s.rank))
    _say(f"      checkpoint of step {m.step}: reason {m.reason}, {len(m.shards)} shard(s) ({per_rank}), "
         f"{_kib(m.total_bytes)} in all, {m.shards[0].algorithm} checksums, world size {m.world_size}")
    for p, mp in ms:
        _say(f"        {p.relative_to(run.root.parent)}")
        # Retention (keep_last) deletes this step once newer ones commit: keep the evidence.
        shutil.copyfile(p, run.root / f"stop-checkpoint.{mp.node}.manifest.json")
    return m


# --------------------------------------------------------------------------------------- comparison
@dataclass
class Comparison:
    """What the two runs agree on."""

    losses_same: bool
    first_loss_diff: str | None
    params_same: bool
    moments_same: bool
    rest_same: bool
    first_state_diff: str | None
    n_params: int
    n_values: int
    n_moments: int

    @property
    def identical(self) -> bool:
        return self.losses_same and self.params_same and self.moments_same and self.rest_same


def _first_diff(a: Any, b: Any, path: str) -> str | None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.shape != b.shape or not torch.equal(a, b):
            return path
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return f"{path} (keys {sorted(map(str, set(a) ^ set(b)))})"
        for k in a:
            d = _first_diff(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else path


def compare(ref: Run, run: Run, steps: int) -> Comparison:
    """Compare the per-step losses and batches, then the final states, of every rank."""
    import torch

    loss_diff = None
    for r in range(ref.ranks):
        a, b = ref.losses(r), run.losses(r)
        if sorted(a) != list(range(1, steps + 1)):
            raise DemoFailed(f"{ref.log(r)}: the reference run did not log every step 1..{steps}")
        if sorted(b) != list(range(1, steps + 1)):
            raise DemoFailed(f"{run.log(r)}: steps missing after the resume: "
                             f"{sorted(set(range(1, steps + 1)) - set(b))[:10]}")
        for s in range(1, steps + 1):
            if a[s] != b[s]:
                what = "loss" if a[s][0] != b[s][0] else "batch"
                loss_diff = f"rank {r} step {s}: {what} {a[s][0]!r} vs {b[s][0]!r}"
                break
        if loss_diff:
            break
    params_same = moments_same = rest_same = True
    state_diff = None
    n_params = n_values = n_moments = 0
    for r in range(ref.ranks):
        fa = torch.load(ref.final(r), weights_only=True)
        fb = torch.load(run.final(r), weights_only=True)
        n_params = len(fa["model"])
        n_values = sum(t.numel() for t in fa["model"].values())
        d = _first_diff(fa["model"], fb["model"], f"rank{r}.model")
        params_same &= d is None
        state_diff = state_diff or d
        moments = {i: {k: v for k, v in st.items() if k.startswith("exp_avg")}
                   for i, st in fa["optimizer"]["state"].items()}
        moments_b = {i: {k: v for k, v in st.items() if k.startswith("exp_avg")}
                     for i, st in fb["optimizer"]["state"].items()}
        n_moments = sum(len(m) for m in moments.values())
        d = _first_diff(moments, moments_b, f"rank{r}.optimizer.state")
        moments_same &= d is None
        state_diff = state_diff or d
        rest_a = {k: v for k, v in fa.items() if k not in ("model",)}
        rest_b = {k: v for k, v in fb.items() if k not in ("model",)}
        d = _first_diff(rest_a, rest_b, f"rank{r}")  # optimizer steps, scheduler, RNG, counters
        rest_same &= d is None
        state_diff = state_diff or d
    return Comparison(loss_diff is None, loss_diff, params_same, moments_same, rest_same, state_diff,
                      n_params, n_values, n_moments)


def _mean_curve(run: Run) -> dict[int, float]:
    per_rank = [run.losses(r) for r in range(run.ranks)]
    return {s: sum(p[s][0] for p in per_rank) / len(per_rank) for s in sorted(per_rank[0]) if all(s in p for p in per_rank)}


def plot(ref: Run, run: Run, out: Path, *, stop_step: int, resumed_from: int, how: str, result: str,
         ranks: int) -> Path | None:
    """Write the loss-curve PNG; None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("      (no loss-curve PNG: matplotlib is not installed; pip install 'resilient_slurm[demo]')")
        return None
    ref_curve = _mean_curve(ref)
    incs = [run.incarnations(r) for r in range(run.ranks)]

    def segment(k: int) -> tuple[list[int], list[float]]:
        steps = sorted(set.intersection(*(set(i[k].steps) for i in incs)))
        return steps, [sum(i[k].steps[s]["loss"] for i in incs) / len(incs) for s in steps]

    fig, (ax, dax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [4, 1]})
    xs = sorted(ref_curve)
    ax.plot(xs, [ref_curve[s] for s in xs], color="#9aa5b1", linewidth=4, label="uninterrupted run")
    styles = [("#d1495b", "--", "first start (stopped)"), ("#2e86ab", ":", "second start (resumed)")]
    for k in range(len(incs[0])):
        sx, sy = segment(k)
        color, ls, label = styles[min(k, 1)]
        ax.plot(sx, sy, color=color, linestyle=ls, linewidth=1.8, label=label if k < 2 else None)
    ax.axvline(stop_step, color="black", linewidth=1)
    if resumed_from != stop_step:
        ax.axvspan(resumed_from, stop_step, color="#d1495b", alpha=0.12, label="steps trained again")
        ax.axvline(resumed_from, color="black", linewidth=1, linestyle="--")
    ymax = max(ref_curve.values())
    if resumed_from == stop_step:
        note = f"{how}: emergency checkpoint\nof step {stop_step}; the rerun\nresumed from step {resumed_from}"
    else:
        note = (f"{how} after step {stop_step}; the rerun\nresumed from step {resumed_from} (last interval\n"
                f"checkpoint): steps {resumed_from + 1}-{stop_step} trained again")
    ax.annotate(note, xy=(stop_step, ymax * 0.75), xytext=(8, 0), textcoords="offset points", fontsize=9)
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.legend(loc="upper right", fontsize=9)
    ax.set_title(f"{result}: tiny transformer LM on {ranks} rank{'s' if ranks > 1 else ''}, stopped by {how} "
                 f"and resumed, vs. never stopped\nevery step's loss, the final weights and AdamW moments compared "
                 "bit for bit", fontsize=10)
    got = _mean_curve(run)
    dx = [s for s in xs if s in got]
    dax.plot(dx, [got[s] - ref_curve[s] for s in dx], color="#2e86ab", linewidth=1.2)
    dax.axvline(stop_step, color="black", linewidth=1)
    dax.set_ylabel("resumed minus\nuninterrupted", fontsize=9)
    dax.set_xlabel("optimizer step")
    fig.tight_layout()
    path = out / "loss_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(ref: Run, run: Run, args: argparse.Namespace, *, stop_step: int, resumed_from: int, how: str) -> int:
    """Step 4 for both modes: compare, print, plot; the demo's exit status."""
    _say("[4/4] comparing with the uninterrupted run")
    cmp = compare(ref, run, args.steps)
    yes = {True: "identical", False: "DIFFERENT"}
    _say(f"      loss and batch of every step ({ref.ranks} rank{'s' if ref.ranks > 1 else ''} x {args.steps} steps): {yes[cmp.losses_same]}"
         + (f" (first: {cmp.first_loss_diff})" if cmp.first_loss_diff else ""))
    _say(f"      final weights ({cmp.n_params} tensors, {cmp.n_values:,} values per rank): "
         f"{'bitwise ' if cmp.params_same else ''}{yes[cmp.params_same]}")
    _say(f"      AdamW moments ({cmp.n_moments} tensors per rank): {'bitwise ' if cmp.moments_same else ''}"
         f"{yes[cmp.moments_same]}")
    _say(f"      optimizer step counts, LR schedule, RNG state, counters: {yes[cmp.rest_same]}"
         + (f" (first difference: {cmp.first_state_diff})" if cmp.first_state_diff else ""))
    curve = _mean_curve(ref)
    _say(f"      loss {curve[1]:.3f} -> {curve[args.steps]:.3f} (mean over ranks, nats per character)")
    exits = [inc.exit for inc in run.incarnations(0) if inc.exit and inc.exit.get("sample")]
    if exits:
        _say(f"      the model now writes: {exits[-1]['sample'][:72]!r}")
    result = "IDENTICAL" if cmp.identical else "DIFFERENT"
    png = plot(ref, run, args.out, stop_step=stop_step, resumed_from=resumed_from, how=how, result=result,
               ranks=args.ranks)
    if png is not None:
        _say(f"      loss curve: {png}")
    _say()
    _say(f"RESULT: {result}")
    return 0 if cmp.identical else 1


def _begin(args: argparse.Namespace) -> tuple[Run, Run]:
    """Empty the output directory, say what runs, and name the two runs' directories."""
    shutil.rmtree(args.out, ignore_errors=True)
    ref, run = Run(args.out / "uninterrupted", args.ranks), Run(args.out / "interrupted", args.ranks)
    ref.root.mkdir(parents=True)
    run.root.mkdir(parents=True)
    _say(f"resilient_slurm demo: a tiny transformer language model, {args.ranks} rank{'s' if args.ranks > 1 else ''}"
         f"{' (DDP over gloo)' if args.ranks > 1 else ''}, {args.steps} steps, "
         f"{'through Slurm' if args.slurm else 'local mode'}; output in {args.out}")
    return ref, run


# --------------------------------------------------------------------------------------- local mode
def _local_env() -> dict[str, str]:
    """This environment without Slurm, torch.distributed or rslurm settings: a plain local run, even
    inside an allocation."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))
           and not (k.startswith("RSLURM_") and k not in KEPT_RSLURM)
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["RSLURM_RUN_ID"] = RUN_ID
    return env


def _launch_argv(run: Run, args: argparse.Namespace) -> list[str]:
    # --kill: the launcher would restart SIGKILLed ranks itself (in-job restarts, docs/launcher.md); the
    # demo turns that off to show the resume across launcher runs, as after a requeue.
    restarts = ["--in-job-restarts", "0"] if args.kill else []
    return [sys.executable, "-m", "resilient_slurm.cli", "launch", *restarts, "-n", str(args.ranks), "--",
            sys.executable, "-m", PROGRAM, *run.program_args(args)]


def _start_launcher(run: Run, args: argparse.Namespace, n: int) -> tuple[subprocess.Popen[bytes], Path]:
    env = _local_env()
    env["RSLURM_LOCAL_DIR"] = run.local_dir
    logf = run.root / f"launcher.{n}.log"
    with open(logf, "ab") as f:
        proc = subprocess.Popen(_launch_argv(run, args), env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=run.root)
    return proc, logf


def _launcher_says(logf: Path, *needles: str) -> str | None:
    """The last launcher log line containing one of ``needles``, without its timestamp and logger."""
    hit = None
    for line in logf.read_text(errors="replace").splitlines():
        if "resilient_slurm.launcher" in line and any(n in line for n in needles):
            hit = line.split(": ", 1)[-1]
    return hit


def _finish(proc: subprocess.Popen[bytes], logf: Path, what: str, want: int) -> float:
    t0 = time.monotonic()
    code = proc.wait()
    if code != want:
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
        raise DemoFailed(f"{what}: `rslurm launch` exited {code}, expected {want}; its log ({logf}):\n{tail}")
    return time.monotonic() - t0


def _pick_stop_step(args: argparse.Namespace) -> int:
    """A random step between two interval checkpoints. SIGTERM: just after one, far from the next, so
    the emergency save (a few steps later) is not the interval save under another name. SIGKILL: late
    in an interval, so the steps trained again after the resume are visible."""
    if args.at is not None:
        return int(args.at)
    every, steps = args.every_steps, args.steps
    lo = every + 1 if steps > 2 * every else 2
    window = range(max(1, every // 2), every - 1) if args.kill else range(1, max(1, every // 3) + 1)
    candidates = [s for s in range(lo, steps - max(3, every // 2)) if s % every in window]
    if not candidates:
        candidates = list(range(2, max(3, steps - 2)))
    return random.SystemRandom().choice(candidates)


def _rank_pids(run: Run) -> list[int]:
    pids = []
    for r in range(run.ranks):
        starts = [e for e in _read_events(run.log(r)) if e.get("event") == "start"]
        if starts:
            pids.append(int(starts[-1]["pid"]))
    return pids


def _read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _wait_for_step(run: Run, step: int, alive: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while run.last_step(0) < step:
        if not alive():
            raise DemoFailed(f"{what} ended before step {step}; see {run.root}")
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} did not reach step {step} within {timeout:.0f} s; see {run.root}")
        time.sleep(0.005)


def run_local(args: argparse.Namespace) -> int:
    ref, run = _begin(args)
    how = "SIGKILL" if args.kill else "SIGTERM"
    at = _pick_stop_step(args)

    _say(f"[1/4] the reference: {args.steps} steps, never interrupted")
    _say(f"      $ {_cmd_text(_launch_argv(ref, args))}")
    t0 = time.monotonic()
    proc, logf = _start_launcher(ref, args, 1)
    _finish(proc, logf, "the uninterrupted run", 0)
    _say(f"      done in {time.monotonic() - t0:.1f} s (exit code 0)")

    target = "the ranks and their DataLoader workers (as the OOM killer or a dying node would)" if args.kill \
        else "the launcher (as a preemption would)"
    _say(f"[2/4] the same command in {run.root.name}/; {how} to {target} at step {at}")
    _say(f"      (interval checkpoints every {args.every_steps} steps)")
    t0 = time.monotonic()
    proc, logf = _start_launcher(run, args, 1)
    try:
        _wait_for_step(run, at, lambda: proc.poll() is None, "the run", timeout=600)
        if args.kill:
            for pid in _rank_pids(run):
                try:
                    os.killpg(pid, signal.SIGKILL)  # each rank leads its own session: rank + workers
                except ProcessLookupError:
                    pass
        else:
            proc.send_signal(signal.SIGTERM)
        sent_at = run.last_step(0)
        _finish(proc, logf, f"the run after {how}", REQUEUE_EXIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    trained = run.last_step(0)
    _say(f"      {how} sent after step {sent_at}; launcher exit code {REQUEUE_EXIT} (EX_TEMPFAIL: run me again), "
         f"{time.monotonic() - t0:.1f} s")
    said = _launcher_says(logf, "run the same command again")
    if said:
        _say(f"      launcher: {said}")
    committed = run.manifests()
    if not committed:
        raise DemoFailed(f"no committed checkpoint under {run.root / 'nvme'}")
    newest = committed[-1][1].step
    m = _describe_checkpoint(run, newest)
    if not args.kill and m.reason != "emergency":
        raise DemoFailed(f"the newest checkpoint (step {newest}) has reason {m.reason!r}, expected 'emergency'")
    _say(f"      last step trained: {trained}; steps lost: {trained - newest}")

    _say("[3/4] the same command once more: it resumes")
    t0 = time.monotonic()
    proc, logf = _start_launcher(run, args, 2)
    _finish(proc, logf, "the resumed run", 0)
    incs = run.incarnations(0)
    resumed_from = incs[-1].start_step
    _say(f"      resumed from step {resumed_from} and finished step {args.steps} in {time.monotonic() - t0:.1f} s")
    if resumed_from != newest:
        raise DemoFailed(f"the run resumed from step {resumed_from}, not from the newest checkpoint {newest}")
    return report(ref, run, args, stop_step=trained, resumed_from=resumed_from, how=how)


# --------------------------------------------------------------------------------------- Slurm mode
SCRIPT = """\
#!/bin/bash
#SBATCH --job-name=rslurm-demo-{kind}
#SBATCH --ntasks={ranks}
#SBATCH --nodes={nodes}
#SBATCH --time={time}
#SBATCH --requeue
#SBATCH --signal=B:USR1@{grace}
#SBATCH --open-mode=append
#SBATCH --output={root}/job.out
#SBATCH --chdir={root}
# Written by `python -m resilient_slurm.examples.demo --slurm`. The launcher must BE the batch shell (exec), so
# that the USR1 sent {grace} s before the time limit (or by `scancel --signal=USR1 --batch`) reaches it.
export RSLURM_LOCAL_DIR={local_dir}
export RSLURM_RUN_ID={run_id}
export PYTHONPATH={pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}
echo "rslurm demo: job $SLURM_JOB_ID incarnation ${{SLURM_RESTART_COUNT:-0}} on $(hostname) at $(date)"
exec {launch} -- srun {python} -m {program} {program_args}
"""


def _slurm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("RSLURM_") and k not in KEPT_RSLURM)
           and not k.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST",
                                 "SBATCH_", "SRUN_"))}
    return env


def _slurm_client(env: Mapping[str, str]) -> CliSlurmClient:
    from ..slurm import CliSlurmClient

    return CliSlurmClient(env=env, timeout=20.0)


def _check_cluster(client: CliSlurmClient) -> str:
    """The controller's answer to `scontrol ping`; ConfigError when there is no cluster to use."""
    if shutil.which("sbatch", path=(client.env or os.environ).get("PATH")) is None:
        raise ConfigError("--slurm: sbatch is not on PATH, so there is no Slurm here; run the demo without "
                          "--slurm for the local version")
    conf = (client.env or os.environ).get("SLURM_CONF")
    if conf and not os.path.exists(conf):
        raise ConfigError(f"--slurm: SLURM_CONF={conf} does not exist; point it at the cluster's slurm.conf")
    from ..slurm import CliSlurmClient

    try:  # one short try: without a controller scontrol itself retries for a minute
        cp = CliSlurmClient(env=client.env, timeout=10.0, retries=0).run(["scontrol", "ping"])
    except ResilientSlurmError as exc:
        raise ConfigError(f"--slurm: no Slurm controller answers `scontrol ping` ({exc}); run the demo "
                          "without --slurm for the local version") from exc
    if "UP" not in cp.stdout:
        raise ConfigError(f"--slurm: `scontrol ping` says {cp.stdout.strip()!r}; no controller is up")
    return cp.stdout.strip().splitlines()[0]


def _launch_prefix() -> str:
    rslurm = Path(sys.executable).parent / "rslurm"
    return shlex.quote(str(rslurm)) + " launch" if rslurm.exists() else \
        f"{shlex.quote(sys.executable)} -m resilient_slurm.cli launch"


def _submit(client: CliSlurmClient, run: Run, args: argparse.Namespace, kind: str) -> int:
    script = SCRIPT.format(
        kind=kind, ranks=args.ranks, nodes=args.nodes, time=args.time, grace=args.grace, root=run.root,
        local_dir=shlex.quote(run.local_dir), run_id=RUN_ID,
        pythonpath=shlex.quote(str(Path(__file__).resolve().parents[2])), launch=_launch_prefix(),
        python=shlex.quote(sys.executable), program=PROGRAM, program_args=shlex.join(run.program_args(args)))
    path = run.root / "job.sh"
    path.write_text(script)
    sbatch_args = [*(["--partition", args.partition] if args.partition else []), *args.sbatch_arg]
    job = client.submit(path, sbatch_args)
    _say(f"      $ sbatch {shlex.join(sbatch_args) + ' ' if sbatch_args else ''}{path}   -> job {job}")
    return job


def _job_text(run: Run, lines: int = 30) -> str:
    p = run.root / "job.out"
    return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else "(no job.out yet)"


class JobWatch:
    """Follows one job through ``scontrol show job``; prints each change of state or restart count with the
    seconds since submission."""

    def __init__(self, client: CliSlurmClient, job: int, run: Run, deadline: float) -> None:
        self.client, self.job, self.run, self.deadline = client, job, run, deadline
        self.t0 = time.monotonic()
        self.last: tuple[str, int] | None = None

    def until(self, pred: Callable[[JobInfo], bool], what: str) -> JobInfo:
        """Poll until ``pred(info)``; DemoFailed when the job ends otherwise or --timeout passes."""
        from ..slurm import FINISHED_STATES

        while True:
            info = self.client.job_info(self.job)
            if (info.state, info.restarts) != self.last:
                self.last = (info.state, info.restarts)
                why = f", reason {info.reason}" if info.reason and info.state == "PENDING" else ""
                _say(f"      +{time.monotonic() - self.t0:5.1f} s  job {self.job}: {info.state}, restarts "
                     f"{info.restarts}{why}")
            if pred(info):
                return info
            if info.state in FINISHED_STATES - {"PREEMPTED"}:
                raise DemoFailed(f"job {self.job} ended {info.state} while waiting for {what}; "
                                 f"{self.run.root / 'job.out'}:\n{_job_text(self.run)}")
            if time.monotonic() > self.deadline:
                raise DemoFailed(f"job {self.job}: {what} did not happen within --timeout; "
                                 f"{self.run.root / 'job.out'}:\n{_job_text(self.run)}")
            time.sleep(0.25)


def run_slurm(args: argparse.Namespace) -> int:
    env = _slurm_env()
    client = _slurm_client(env)
    ping = _check_cluster(client)
    ref, run = _begin(args)
    deadline = time.monotonic() + args.timeout
    at = _pick_stop_step(args)
    jobs: list[int] = []
    _say(f"      Slurm: {ping}")
    try:
        _say(f"[1/4] the reference job: {args.steps} steps, never interrupted")
        jobs.append(ref_job := _submit(client, ref, args, "reference"))
        JobWatch(client, ref_job, ref, deadline).until(lambda i: i.state == "COMPLETED", "completion")

        _say(f"[2/4] the same job again; after step {at}: scancel --signal=USR1 --batch, the signal "
             f"--signal=B:USR1@{args.grace} sends before the time limit")
        jobs.append(job := _submit(client, run, args, "training"))
        for line in (run.root / "job.sh").read_text().splitlines():
            if line.startswith(("#SBATCH --requeue", "#SBATCH --signal", "exec ")):
                line = line.replace(str(Path(sys.executable).parent / "rslurm"), "rslurm")
                line = line.replace(shlex.quote(sys.executable), "python")
                _say(f"        {line if len(line) < 100 else line[:97] + '...'}")
        watch = JobWatch(client, job, run, deadline)
        watch.until(lambda i: i.state == "RUNNING", "the start")
        _wait_for_step(run, at, lambda: True, f"job {job}", timeout=max(1.0, deadline - time.monotonic()))
        client.signal(job, signal.SIGUSR1, batch=True)
        sent_at = run.last_step(0)
        _say(f"      +{time.monotonic() - watch.t0:5.1f} s  USR1 to the batch shell (the launcher) after step {sent_at}")
        watch.until(lambda i: i.restarts >= 1, "the requeue")
        said = _launcher_says(run.root / "job.out", "requeued", "not requeued")
        if said:
            _say(f"      launcher: {said}")
        first = run.incarnations(0)[0]
        trained = max(first.steps, default=0)
        committed = run.manifests()
        if not committed:
            raise DemoFailed(f"job {job} was requeued but nothing is committed under {run.root / 'nvme'}")
        newest = committed[-1][1].step
        m = _describe_checkpoint(run, newest)
        if m.reason != "emergency":
            raise DemoFailed(f"the newest checkpoint (step {newest}) has reason {m.reason!r}, expected 'emergency'")
        _say(f"      last step trained: {trained}; steps lost: {trained - newest}")

        _say("[3/4] Slurm starts the job again (after the requeue delay); it resumes")
        info = watch.until(lambda i: i.state == "COMPLETED", "completion")
        incs = run.incarnations(0)
        resumed_from = incs[-1].start_step
        _say(f"      incarnation {incs[-1].restart_count} resumed from step {resumed_from}; job {job} COMPLETED "
             f"after {info.restarts} requeue{'s' if info.restarts != 1 else ''}")
        if resumed_from != newest:
            raise DemoFailed(f"job {job} resumed from step {resumed_from}, not from the emergency step {newest}")
        jobs.clear()
    finally:
        for j in jobs:  # interrupted or failed: leave nothing running
            try:
                if not client.job_info(j).finished:
                    client.cancel(j)
                    _say(f"      cancelled job {j}")
            except ResilientSlurmError:
                pass
    return report(ref, run, args, stop_step=trained, resumed_from=resumed_from, how="USR1 from Slurm")


# --------------------------------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m resilient_slurm.examples.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="ranks (DDP over gloo when > 1; default 2)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    ap.add_argument("--every-steps", type=int, default=25, help="interval checkpoint cadence (default 25)")
    ap.add_argument("--out", type=Path, default=Path("demo-output"),
                    help="working directory, emptied first (default ./demo-output)")
    ap.add_argument("--kill", action="store_true",
                    help="SIGKILL the ranks instead of SIGTERM to the launcher: nothing is saved at that moment, "
                         "the rerun resumes from the last interval checkpoint")
    ap.add_argument("--at", type=int, default=None, help="stop at this step instead of a random one")
    slurm = ap.add_argument_group("Slurm (--slurm)")
    slurm.add_argument("--slurm", action="store_true", help="run the jobs through sbatch on the Slurm cluster here")
    slurm.add_argument("--partition", default=None, help="sbatch --partition (default: the cluster's default)")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes per job (default 1)")
    slurm.add_argument("--time", type=int, default=15,
                       help="each job's time limit in minutes (default 15: within it, USR1 means the time limit)")
    slurm.add_argument("--grace", type=int, default=120,
                       help="seconds before the time limit for --signal=B:USR1@ (default 120)")
    slurm.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                       help="extra sbatch option, repeatable (--sbatch-arg=--exclusive)")
    slurm.add_argument("--timeout", type=float, default=900.0,
                       help="give up on the jobs after this many seconds (default 900)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m resilient_slurm.examples.demo`` and ``rslurm demo [--] ARGS``."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        if args.ranks < 1 or args.every_steps < 1 or args.steps < 4 or args.nodes < 1:
            raise ConfigError("--ranks, --nodes and --every-steps must be >= 1 and --steps >= 4")
        if args.at is not None and not 1 <= args.at < args.steps:
            raise ConfigError(f"--at {args.at}: pick a step in 1..{args.steps - 1}")
        if args.kill and args.slurm:
            raise ConfigError("--kill is for the local demo; --slurm shows the USR1 -> save -> requeue path")
        args.out = args.out.resolve()
        return run_slurm(args) if args.slurm else run_local(args)
    except ResilientSlurmError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    except DemoFailed as exc:
        print(f"demo: FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
