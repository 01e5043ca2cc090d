"""Run a worker in a topology, SIGKILL it at a step, resume, and compare every rank with an uninterrupted run
(tests/test_topology_matrix.py, tests/test_ddp_layout.py, tests/test_model_parallel.py).

The worker is tests/workers/topology_worker.py with ``--kinds`` (``kinds``), or another program taking
``--steps --every --log --out --sleep`` (``worker`` and its ``args``: tests/workers/parallel_worker.py)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from pathlib import Path

import torch
from conftest import REPO, assert_same, once, read_jsonl, run_ranks, start_ranks, wait_for_step

WORKER = str(REPO / "tests" / "workers" / "topology_worker.py")
PARALLEL_WORKER = str(REPO / "tests" / "workers" / "parallel_worker.py")
STEPS = 14
EVERY = 3
KINDS = ("ddp", "obj", "plain", "repl", "fsdp")

# An uninterrupted run depends on the world size, the program (worker, kinds or arguments) and its settings
# only (not on node names or directories): made once per test process (conftest.once).
_ROOT = Path(tempfile.mkdtemp(prefix="rslurm-matrix-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def _env(nodes: int, per_node: int, layout: str, where: Path) -> list[dict[str, str]]:
    out = []
    for r in range(nodes * per_node):
        node, local = f"n{r // per_node + 1}", r % per_node
        local_dir = {"node": str(where / "nvme" / "%n"), "shared": str(where / "shared"),
                     "rank": str(where / "nvme" / node / f"gpu{local}")}[layout]
        out.append({"SLURMD_NODENAME": node, "LOCAL_RANK": str(local), "RSLURM_LOCAL_DIR": local_dir})
    return out


def _program(kinds: tuple[str, ...], worker: str | None = None, args: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The worker and its own arguments: topology_worker.py with ``--kinds``, or ``worker`` with ``args``."""
    return (worker, *args) if worker else (WORKER, "--kinds", ",".join(kinds))


def _argv(kinds: tuple[str, ...], d: Path, sleep: float = 0.0, steps: int = STEPS, every: int = EVERY,
          program: tuple[str, ...] = ()) -> list[str]:
    return [*(program or _program(kinds)), "--steps", str(steps), "--every", str(every),
            "--log", str(d / "log.%r.jsonl"), "--out", str(d / "out.%r.pt"), "--sleep", str(sleep)]


def train(world: int, kinds: tuple[str, ...], d: Path, *, steps: int, every: int) -> None:
    """Run the worker to ``steps`` in ``d`` (one node, one directory); a second call resumes."""
    run_ranks(_argv(kinds, d, steps=steps, every=every), world, d, timeout=300, env={"RSLURM_RUN_ID": "topo"},
              per_rank_env=_env(1, world, "node", d))


def assert_same_run(ref: Path, d: Path, world: int) -> None:
    """Every rank's final state and every step's loss are equal in ``ref`` and ``d``."""
    for r in range(world):
        a = torch.load(ref / f"out.{r}.pt", weights_only=True)
        b = torch.load(d / f"out.{r}.pt", weights_only=True)
        assert_same(a, b, f"rank{r}")
        la, lb = _losses(ref / f"log.{r}.jsonl"), _losses(d / f"log.{r}.jsonl")
        assert la == lb, f"rank {r}: losses differ at steps {[s for s in la if la[s] != lb.get(s)]}"


def _reference(world: int, program: tuple[str, ...], env: dict[str, str]) -> Path:
    def make(d: Path) -> None:
        run_ranks(_argv((), d, program=program), world, d, timeout=300, env=env,
                  per_rank_env=_env(1, world, "node", d))

    return once(("resume_matrix reference", world, program, tuple(sorted(env.items()))), make)


def _losses(log: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in read_jsonl(log):
        if "loss" in e:
            assert out.setdefault(e["step"], e["loss"]) == e["loss"], f"{log}: step {e['step']} re-done differently"
    return out


def _committed_domains(d: Path) -> int:
    """How many run directories under ``d`` hold a committed step (a manifest inside a step_X.tmp-* directory
    is a save not yet renamed into place: not committed). A walk that meets a directory the ranks renamed or
    removed meanwhile (a save committing, retention) counts nothing this time: the caller asks again."""
    try:
        return len({p.parent.parent for p in d.glob("**/topo/step_*/manifest.json")
                    if p.parent.name[len("step_"):].isdigit()})
    except FileNotFoundError:
        return 0


def check_resume(nodes: int, per_node: int, layout: str, kinds: tuple[str, ...], kill_at: int, *,
                 worker: str | None = None, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
    """SIGKILL ``kinds`` of topology_worker.py (or ``worker`` with ``args``) on ``nodes`` x ``per_node`` ranks
    in directory ``layout`` once rank 0 passed ``kill_at`` and every domain committed a step; resume; every
    rank's final state and losses must equal an uninterrupted run's. ``env``: settings for every run."""
    world = nodes * per_node
    program = _program(kinds, worker, args)
    env = {"RSLURM_RUN_ID": "topo", **(env or {})}
    ref = _reference(world, program, env)
    d = Path(tempfile.mkdtemp(prefix=f"n{nodes}x{per_node}-{layout}-", dir=_ROOT))
    per_rank = _env(nodes, per_node, layout, d)
    job = start_ranks(_argv(kinds, d, sleep=0.05, program=program), world, d, env=env, per_rank_env=per_rank)
    domains = {"node": nodes, "shared": 1, "rank": world}[layout]
    try:
        wait_for_step(d / "log.0.jsonl", kill_at, timeout=240, job=job)
        # A save is asynchronous: on a loaded machine the first one may not have committed yet. Kill only
        # once every domain committed a step, so that the resume starts from one.
        deadline = time.monotonic() + 120
        while _committed_domains(d) < domains:
            assert time.monotonic() < deadline, f"no step committed in every domain of {d}"
            time.sleep(0.01)
    finally:
        job.kill()  # SIGKILL every rank, wherever it is (maybe in the middle of a save)
    assert not (d / "out.0.pt").exists(), "the run finished before it was killed"
    run_ranks(_argv(kinds, d, program=program), world, d, timeout=300, env=env, per_rank_env=per_rank)
    starts = [e["step"] for e in read_jsonl(d / "log.0.jsonl") if e.get("event") == "start"]
    assert len(starts) == 2 and starts[1] > 0, f"did not resume from a checkpoint: {starts}"
    assert_same_run(ref, d, world)
    shutil.rmtree(d, ignore_errors=True)
