"""Recovery benchmark: a rank SIGKILLed -> the ranks training again; in-job restart against requeue.

    .venv/bin/python bench/bench_recovery.py [--repeats 3] [--requeue-repeats 3] [--no-slurm] [--quick]
                                             [--state-mib 192] [--step-s 0.1] [--code head|worktree]
                                             [--dir DIR] [--keep] [--json OUT] [--wait-quiet S]

A 2-rank training program (bench/recovery_worker.py: gloo, ~``--state-mib`` of model + Adam state on
each rank, ``Checkpointer(every_steps=10)``, a ``--step-s`` step) runs under ``rslurm launch``. After
step 25 rank 1 SIGKILLs itself (once: a marker file), the last commit being step 20. The launcher must
notice, bring the ranks back from step 20 and the run must complete. Scenarios, in rounds that rotate
their order:

* ``local-injob``: ``rslurm launch -n 2 -- python bench/recovery_worker.py``, default settings: the
  launcher restarts the ranks as new processes (an in-job restart, after its backoff);
* ``slurm-injob`` (root; the private 2-node cluster of tests/slurm_cluster.py): a batch job
  ``exec rslurm launch -- srun -N2 -n2 python bench/recovery_worker.py``, one rank per node, default
  settings: the launcher starts a new srun step inside the allocation;
* ``slurm-requeue``: the same job with ``RSLURM_IN_JOB_RESTARTS=0``: the launcher requeues the job
  (``scontrol requeue``), Slurm runs the batch script again, a new launcher starts a new srun step.

Every time is a wall-clock ``time.time()`` on this one host, counted from the ``kill`` line rank 1
writes just before ``os.kill(SIGKILL)``. The launcher's side comes from its records in the run's
``events.jsonl`` (``ranks_exited``, ``in_job_restart`` with its ``backoff_s``, ``decision``,
``requeue_call``, ``start``); Slurm's from polling ``scontrol show job`` (PENDING/RUNNING again),
a line the batch script writes when it starts, and the slurmd log's "launch task StepId=" lines (the
health-check step and the ranks' step); the ranks' from the worker's own log: process created (kernel,
/proc), Python up (the script's first line), imports, init_distributed, model built, restore() done,
first step after the resume done. Rank phases are the later of the two ranks (the ranks train in lock
step). The goal (the issue's): the first step after the resume within 10 s + the restore time.

Also measured: the heartbeat's cost per step (``bench/bench_heartbeat.py``, run as a program) and, in
the runs, what ``ckpt.step()`` took on steps without a save.

The code measured is, by default, a snapshot of ``git HEAD`` (``git archive``; the worker is copied from
the working tree): every launch imports the library, and the working tree may be edited while this runs.
``--code worktree`` measures the working tree instead; a PROBLEM is reported if its sources change
during the run. See bench/README.md; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import (  # noqa: E402
    BenchBase,
    add_wait_quiet_arg,
    cpu_sample,
    fmt,
    foreign_load,
    git_facts,
    machine_facts,
    med,
    now,
    ratio,
    read_jsonl,
    run_main,
    tail,
)

PY = sys.executable
SCENARIOS = ("local-injob", "slurm-injob", "slurm-requeue")
GOAL_S = 10.0  # the goal: training again within 10 s plus the restore time
WORKER_DEFAULTS = {"every_steps": 10, "crash_at": 25, "steps": 30}

# The timeline, in order. (key, label, chain): ``chain`` rows are precise timestamps that follow each other
# in one scenario, and the phase durations are the differences between consecutive ones; the others (the
# peer's error, which runs beside the launcher's notice, and Slurm's states, seen by polling) are shown
# as times from the kill only.
ROWS: list[tuple[str, str, bool]] = [
    ("peer_error", "rank 0's collective fails (peer gone)", False),
    ("ranks_exited", "launcher: every rank gone (ranks_exited)", True),
    ("decided", "launcher: restart (in_job_restart) / requeue (decision) decided", True),
    ("backoff_end", "  in-job backoff over (in_job_restart + backoff_s)", True),
    ("requeue_call", "launcher: scontrol requeue issued (requeue_call)", True),
    ("pending", "  Slurm: job PENDING again (poll)", False),
    ("running", "  Slurm: job RUNNING again (poll)", False),
    ("batch_start", "Slurm: batch script runs again", True),
    ("launcher_start", "new launcher's start event", True),
    ("health_step", "health-check srun step launched (slurmd log)", True),
    ("rank_step", "ranks' srun step launched (slurmd log)", True),
    ("proc_created", "rank processes created (/proc, 10 ms; later rank)", True),
    ("proc_start", "  Python up: the worker's first line", True),
    ("imports", "  import torch + resilient_slurm done", True),
    ("init", "  init_distributed (gloo) done", True),
    ("built", "  model + Adam built", True),
    ("restored", "  restore() done", True),
    ("first_step", "FIRST STEP AFTER THE RESUME done", True),
]
RANK_PHASES = ("proc_start", "imports", "init", "built", "restored")
SLURMD_LAUNCH = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)\].*launch task StepId=(\d+)\.(\d+)")




def first_after(events: list[dict[str, Any]], kind: str, t: float) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == kind and float(e.get("t", 0)) >= t), None)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without Slurm, torch.distributed or rslurm variables, plus ``extra``."""
    drop = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "RSLURM_")
    dist = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "NODE_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in dist}
    env.update(extra)
    return env


def sources_digest(root: str) -> str:
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "resilient_slurm", "**", "*.py"), recursive=True)):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            h.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def slurmd_launches(path: str, job: int, since: float) -> list[tuple[float, int]]:
    """(time, step id) of the steps of ``job`` the slurmd log says it launched at or after ``since``."""
    out: dict[int, float] = {}
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for line in f:
            m = SLURMD_LAUNCH.match(line)
            if not m or int(m.group(2)) != job:
                continue
            stamp = m.group(1)
            fmt_ = "%Y-%m-%dT%H:%M:%S.%f" if "." in stamp else "%Y-%m-%dT%H:%M:%S"
            t = datetime.datetime.strptime(stamp, fmt_).timestamp()  # local time, as slurmd writes it
            if t >= since - 0.002:
                out.setdefault(int(m.group(3)), t)
    return sorted((t, s) for s, t in out.items())


class Bench(BenchBase):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, "rslurm-bench-recovery-")
        self.r: dict[str, Any] = {"errors": {}, "problems": [], "runs": []}
        self.code = REPO
        self.cluster: Any = None

    def problem(self, msg: str) -> None:
        self.log("PROBLEM: " + msg)
        self.r["problems"].append(msg)

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        self.r["machine"] = machine_facts(self.root)
        self.r["git"] = git_facts()
        if self.args.code == "head":
            # What HEAD holds, not what the working tree holds right now: others may be editing it.
            dst = os.path.join(self.root, "code")
            os.makedirs(dst)
            paths = ["resilient_slurm", "bench", "tests/slurm_cluster.py"]
            archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", *paths], cwd=REPO,
                                     capture_output=True, check=True, timeout=60).stdout
            subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True, timeout=60)
            # The benchmark's own worker and helpers come from the working tree (they measure, not measured).
            for name in ("recovery_worker.py", "common.py"):
                shutil.copy2(os.path.join(HERE, name), os.path.join(dst, "bench", name))
            self.code = dst
        self.r["code"] = {"mode": self.args.code, "path": self.code, "sources_sha256": sources_digest(self.code),
                          "head": self.r["git"].get("head")}
        self.log(f"measuring the code in {self.code} ({self.args.code}; sources {self.r['code']['sources_sha256']})")

    def rank_env(self, d: str, run_id: str) -> dict[str, str]:
        # A private control-socket directory: the default is shared by every private test cluster on this
        # host, and their job ids all start at 1. MASTER_ADDR: n1 and n2 are names only Slurm knows.
        env = {"PYTHONPATH": self.code, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "RSLURM_LOCAL_DIR": os.path.join(d, "nvme", "%n"), "RSLURM_RUN_ID": run_id,
               "RSLURM_CONTROL_DIR": os.path.join(self.root, "ctl"), "RSLURM_DAEMON": "off",
               "RSLURM_LOG_LEVEL": "INFO"}
        return env

    def worker_argv(self, d: str) -> list[str]:
        a = self.args
        return [PY, os.path.join(self.code, "bench", "recovery_worker.py"), "--log-dir", os.path.join(d, "logs"),
                "--state-mib", str(a.state_mib), "--step-s", str(a.step_s),
                *(f"--{k.replace('_', '-')}={v}" for k, v in WORKER_DEFAULTS.items())]

    # ---------------------------------------------------------------- heartbeat
    def heartbeat(self) -> None:
        script = os.path.join(self.code, "bench", "bench_heartbeat.py")
        if not os.path.exists(script):
            script = os.path.join(HERE, "bench_heartbeat.py")
        calls, repeats = (50_000, 3) if self.args.quick else (200_000, 7)
        cp = subprocess.run([PY, script, "--calls", str(calls), "--repeats", str(repeats)], cwd=self.code,
                            env=clean_env({"PYTHONPATH": self.code}), capture_output=True, text=True, timeout=600)
        if cp.returncode != 0:
            raise RuntimeError(f"bench_heartbeat.py exited {cp.returncode}: {cp.stderr[-2000:]}")
        hb: dict[str, Any] = {"calls": calls, "repeats": repeats, "output": cp.stdout}
        for key, pat in (("beat_us", r"heartbeat beat\(\):\s+([\d.]+) us"), ("empty_call_us", r"empty method call:\s+([\d.]+)"),
                         ("control_poll_us", r"control socket poll:\s+([\d.]+)"),
                         ("launcher_read_us", r"launcher read \(1 rank\):\s+([\d.]+)")):
            m = re.search(pat, cp.stdout)
            hb[key] = float(m.group(1)) if m else None
        if hb["beat_us"] is None:
            raise RuntimeError(f"cannot read bench_heartbeat.py's output:\n{cp.stdout}")
        self.r["heartbeat"] = hb
        self.log(f"heartbeat beat(): {hb['beat_us']:.3f} us per step")

    # ---------------------------------------------------------------- one run
    def measured(self, name: str, fn: Callable[[int], None], i: int) -> None:
        a = cpu_sample()
        time.sleep(1.0)  # what other processes (the idle cluster's daemons included) use before the run
        bg = foreign_load(a, cpu_sample())
        self.r.setdefault("background_cpu_load", {}).setdefault(name, []).append(round(bg, 2))

        def done(dt: float, load: float | None) -> None:
            self.log(f"round {i} {name}: {dt:.1f}s (CPU of other processes, the launched job included: "
                     f"{load:.2f} cores; before the run: {bg:.2f})")

        self.guarded(name, lambda: fn(i), done, error_list=True)

    def rank_logs(self, d: str) -> dict[str, list[dict[str, Any]]]:
        return {os.path.basename(p)[4:-6]: read_jsonl(p) for p in sorted(glob.glob(os.path.join(d, "logs", "rank*.jsonl")))}

    def launcher_events(self, d: str, run_id: str) -> list[dict[str, Any]]:
        ev = []
        for p in glob.glob(os.path.join(d, "nvme", "*", run_id, "events.jsonl")):
            ev += [e for e in read_jsonl(p) if e.get("source") == "launcher"]
        return sorted(ev, key=lambda e: float(e.get("t", 0)))

    def analyse(self, scen: str, i: int, d: str, run_id: str) -> dict[str, Any]:
        """The run's timeline, from rank 1's ``kill`` line."""
        rec: dict[str, Any] = {"scenario": scen, "round": i, "at": {}}
        logs = self.rank_logs(d)
        events = self.launcher_events(d, run_id)
        rec["launcher_events"] = [e.get("event") for e in events]
        kills = [e for recs in logs.values() for e in recs if e.get("event") == "kill"]
        if len(kills) != 1:
            self.problem(f"{scen}/{i}: {len(kills)} kill lines in the worker logs, expected 1")
            return rec
        tk = float(kills[0]["t"])
        rec["kill_t"] = tk
        rec["crash_step"] = kills[0].get("step")
        at: dict[str, float | None] = rec["at"]

        def put(key: str, t: float | None) -> None:
            at[key] = None if t is None else t - tk

        errs = [e["t"] for recs in logs.values() for e in recs if e.get("event") == "peer_error" and e["t"] >= tk]
        put("peer_error", min(errs) if errs else None)
        rec["peer_errors"] = sorted({e.get("error", "")[:120] for recs in logs.values() for e in recs
                                     if e.get("event") == "peer_error"})
        e = first_after(events, "ranks_exited", tk)
        put("ranks_exited", e and e["t"])
        restart = first_after(events, "in_job_restart", tk)
        decision = first_after(events, "decision", tk)
        if scen.endswith("injob"):
            if restart is None:
                self.problem(f"{scen}/{i}: no in_job_restart event after the kill; events: {rec['launcher_events']}")
            else:
                put("decided", restart["t"])
                rec["backoff_s"] = restart.get("backoff_s")
                rec["restart_outcome"] = restart.get("outcome")
                rec["restart_committed_step"] = restart.get("committed_step")
                put("backoff_end", restart["t"] + float(restart.get("backoff_s") or 0))
            if len([x for x in events if x.get("event") == "in_job_restart"]) != 1:
                self.problem(f"{scen}/{i}: expected one in_job_restart event: {rec['launcher_events']}")
        else:
            if restart is not None:
                self.problem(f"{scen}/{i}: an in_job_restart with in_job_restarts=0: {restart}")
            if decision is None:
                self.problem(f"{scen}/{i}: no decision event after the kill; events: {rec['launcher_events']}")
            else:
                put("decided", decision["t"])
                rec["decision"] = {k: decision.get(k) for k in ("action", "rule", "outcome", "committed_step")}
                if decision.get("action") != "requeue":
                    self.problem(f"{scen}/{i}: decision {rec['decision']}, expected requeue")
            e = first_after(events, "requeue_call", tk)
            put("requeue_call", e and e["t"])
            e = next((x for x in events if x.get("event") == "start" and x["t"] >= tk), None)
            put("launcher_start", e and e["t"])
            b = next((x for x in read_jsonl(os.path.join(d, "batch.jsonl")) if x["t"] >= tk), None)
            put("batch_start", b and b["t"])
        # the ranks' new processes: per rank, the first process that started after the kill
        per_rank: dict[str, dict[str, float]] = {}
        restored_steps, restore_s, first_dt = set(), [], []
        for rank, recs in logs.items():
            start = next((x for x in recs if x.get("event") == "proc_start" and x["t"] >= tk), None)
            if start is None:
                continue
            mine = [x for x in recs if x.get("pid") == start["pid"]]
            got = {"proc_start": start["t"]}
            if start.get("created_t") is not None:
                got["proc_created"] = start["created_t"]
            for kind in RANK_PHASES[1:]:
                x = next((y for y in mine if y.get("event") == kind), None)
                if x is not None:
                    got[kind] = x["t"]
                    if kind == "restored":
                        restored_steps.add(x.get("step"))
                        restore_s.append(x.get("restore_s"))
            st = next((y for y in mine if y.get("event") == "step"), None)
            if st is not None:
                got["first_step"] = st["t"]
                first_dt.append(st.get("dt"))
            if not any(y.get("event") == "done" for y in mine):
                self.problem(f"{scen}/{i}: rank {rank}'s resumed process did not finish")
            per_rank[rank] = got
        if len(per_rank) != 2:
            self.problem(f"{scen}/{i}: {len(per_rank)} rank(s) started again after the kill, expected 2")
        for key in ("proc_created", *RANK_PHASES, "first_step"):
            ts = [g.get(key) for g in per_rank.values()]
            put(key, max(ts) if ts and None not in ts else None)  # the later rank: they train in lock step
        created = [g.get("proc_created") for g in per_rank.values() if g.get("proc_created") is not None]
        rec["first_rank_created_s"] = min(created) - tk if created else None
        steps = sorted(restored_steps, key=str)
        rec["restored_step"] = steps[0] if len(steps) == 1 else steps
        rec["restore_s"] = max((x for x in restore_s if x is not None), default=None)
        rec["first_step_dt"] = max((x for x in first_dt if x is not None), default=None)
        if rec["restored_step"] in (0, None) or isinstance(rec["restored_step"], list):
            self.problem(f"{scen}/{i}: restored step(s) {rec['restored_step']}, expected one step > 0")
        # Steps without a save, except each process's first: what ckpt.step() costs per step (the heartbeat,
        # and every sync_every steps the ranks' agreement, which includes waiting for the slower rank).
        ck, dts = [], []
        for recs in logs.values():
            seen_pids: set[int] = set()
            for x in recs:
                if x.get("event") != "step":
                    continue
                if x["pid"] not in seen_pids:
                    seen_pids.add(x["pid"])
                    continue
                dts.append(x["dt"])
                if not x.get("save"):
                    ck.append(x["ckpt_s"])
        rec["ckpt_step_s"] = ck
        rec["step_dt_median_s"] = med(dts)
        if at.get("first_step") is not None and rec["restore_s"] is not None:
            rec["goal_s"] = GOAL_S + rec["restore_s"]
            rec["goal_met"] = at["first_step"] <= rec["goal_s"]
            rec["first_step_less_restore_s"] = at["first_step"] - rec["restore_s"]
        return rec

    # ---------------------------------------------------------------- local
    def run_local(self, i: int) -> None:
        scen = "local-injob"
        d = os.path.join(self.root, f"{scen}-{i}")
        os.makedirs(d)
        run_id = f"rec-{scen}-{i}"
        out_path = os.path.join(d, "launcher.out")
        env = clean_env(self.rank_env(d, run_id))
        cmd = [PY, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", *self.worker_argv(d)]
        with open(out_path, "wb") as out:
            try:
                cp = subprocess.run(cmd, env=env, cwd=self.code, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, timeout=self.args.run_timeout)
            except subprocess.TimeoutExpired:
                self.problem(f"{scen}/{i}: the launcher ran past {self.args.run_timeout:.0f}s:\n{tail(out_path)}")
                raise
        rec = self.analyse(scen, i, d, run_id)
        rec["exit_code"] = cp.returncode
        if cp.returncode != 0:
            self.problem(f"{scen}/{i}: the launcher exited {cp.returncode}, expected 0:\n{tail(out_path)}")
        self.finish_run(rec)

    def finish_run(self, rec: dict[str, Any]) -> None:
        self.r["runs"].append(rec)
        at = rec["at"]
        self.log(f"{rec['scenario']}/{rec['round']}: first step after the resume {fmt(at.get('first_step'), '.2f', ' s')} "
                 f"after the kill (restore {fmt(rec.get('restore_s'), '.2f', ' s')}, restored step "
                 f"{rec.get('restored_step')})")

    # ---------------------------------------------------------------- Slurm
    def start_cluster(self) -> None:
        sys.path.insert(0, os.path.join(self.code, "tests"))
        from slurm_cluster import SlurmCluster

        c = SlurmCluster()
        t0 = now()
        c.start(timeout=120)
        self.cluster = c
        self.r["slurm_cluster_start_s"] = now() - t0
        self.log(f"Slurm test cluster up in {now() - t0:.1f}s ({c.root})")

    def run_slurm(self, scen: str, i: int) -> None:
        c = self.cluster
        d = os.path.join(self.root, f"{scen}-{i}")
        os.makedirs(d)
        run_id = f"rec-{scen}-{i}"
        out_path = os.path.join(d, "job.out")
        env = self.rank_env(d, run_id)
        if scen == "slurm-requeue":
            env["RSLURM_IN_JOB_RESTARTS"] = "0"
        exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
        launch = " ".join([PY, "-m", "resilient_slurm.cli", "launch", "--", "srun", "-N2", "-n2", *self.worker_argv(d)])
        stamp = ('echo "{\\"event\\": \\"batch_start\\", \\"t\\": $(date +%s.%N), \\"restart_count\\": '
                 f'${{SLURM_RESTART_COUNT:-0}}}}" >> {d}/batch.jsonl\n')
        script = f"#!/bin/bash\n{stamp}{exports}cd {self.code}\nexec {launch}\n"
        job = c.sbatch(script, "-p", "low", "--requeue", "-N2", "--exclusive", "--open-mode=append", "-o", out_path,
                       "-J", scen)
        seen: list[tuple[float, str, str]] = []  # (first poll time, JobState, Restarts) of each new pair
        poll = 0.2 if scen == "slurm-requeue" else 0.5
        deadline = time.monotonic() + self.args.run_timeout
        info: dict[str, str] | None = None
        done = False
        try:
            while True:
                t = time.time()
                info = c.job_info(job)
                st, restarts = (info.get("JobState", "?"), info.get("Restarts", "?")) if info else ("GONE", "?")
                if not seen or seen[-1][1:] != (st, restarts):
                    seen.append((t, st, restarts))
                if st == "COMPLETED":
                    done = True
                    break
                if st in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"):
                    raise RuntimeError(f"job {job} ended {st}: {info}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"job {job} not COMPLETED within {self.args.run_timeout:.0f}s: {info}")
                time.sleep(poll)
        except Exception:
            self.problem(f"{scen}/{i}: job {job} failed the scenario; states {seen}\n"
                         f"job output tail:\n{tail(out_path)}")
            raise
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    c.scancel(job)
            with contextlib.suppress(Exception):
                c.wait_queue_empty(timeout=60)
        rec = self.analyse(scen, i, d, run_id)
        rec["job_id"] = job
        rec["job_states"] = [(round(t - rec.get("kill_t", t), 3), st, rs) for t, st, rs in seen]
        rec["restarts"] = info.get("Restarts") if info else None
        tk = rec.get("kill_t")
        if tk is not None:
            if scen == "slurm-requeue":
                for key, state in (("pending", "PENDING"), ("running", "RUNNING")):
                    t = next((t for t, st, rs in seen if st == state and rs == "1" and t >= tk), None)
                    rec["at"][key] = None if t is None else t - tk
            # the slurmd log of the batch host: the steps launched after the kill
            launches = slurmd_launches(os.path.join(str(c.log_dir), "slurmd-n1.log"), job, tk)
            rec["step_launches"] = [(round(t - tk, 3), s) for t, s in launches]
            # Bounded by "Python up" (the worker's own clock): /proc's creation time rests on the boot time in
            # /proc/stat, whole seconds, and can read up to 1 s early.
            start = rec["at"].get("proc_start")
            ranks = [x for x in launches if start is None or x[0] - tk <= start + 0.05]
            if ranks:
                rec["at"]["rank_step"] = ranks[-1][0] - tk
                if len(ranks) >= 2:
                    rec["at"]["health_step"] = ranks[-2][0] - tk
            elif launches or os.path.exists(os.path.join(str(c.log_dir), "slurmd-n1.log")):
                self.r.setdefault("notes", []).append(f"{scen}/{i}: no step launch found in the slurmd log")
        want = "1" if scen == "slurm-requeue" else "0"
        if rec["restarts"] != want:
            self.problem(f"{scen}/{i}: the job ended with Restarts={rec['restarts']}, expected {want}")
        self.finish_run(rec)

    # ---------------------------------------------------------------- main
    def run(self) -> dict[str, Any]:
        a = self.args
        try:
            self.setup()
            self.guarded("heartbeat", self.heartbeat, lambda dt, _: self.log(f"heartbeat benchmark: {dt:.1f}s"),
                         cpu_load=False)
            plan: list[tuple[str, int, Callable[[int], None]]] = [("local-injob", a.repeats, self.run_local)]
            if a.slurm:
                plan += [("slurm-injob", a.repeats, lambda i: self.run_slurm("slurm-injob", i)),
                         ("slurm-requeue", a.requeue_repeats, lambda i: self.run_slurm("slurm-requeue", i))]
                self.start_cluster()
            try:
                for i in range(max(n for _, n, _ in plan)):
                    k = i % len(plan)
                    for name, n, fn in plan[k:] + plan[:k]:
                        if i < n:
                            self.measured(name, fn, i)
            finally:
                if self.cluster is not None:
                    self.cluster.stop()
        finally:
            if a.keep:
                self.log(f"kept {self.root}")
            else:
                shutil.rmtree(self.root, ignore_errors=True)
        end = git_facts()
        if a.code == "worktree" and end.get("sources_sha256") != self.r.get("git", {}).get("sources_sha256"):
            # Every launch imports the library from the working tree: the runs did not all measure the same code.
            self.problem(f"the code changed during the run: {self.r.get('git')} at the start, {end} at the end")
        self.r["git_at_end"] = end
        self.r["config"] = {k: getattr(a, k) for k in ("repeats", "requeue_repeats", "slurm", "state_mib", "step_s",
                                                        "code", "quick")}
        self.r["config"]["worker"] = dict(WORKER_DEFAULTS)
        self.r["summary"] = summarize(self.r)
        return self.r


# --------------------------------------------------------------------------------------------- report


def stats(vals: list[float | None]) -> dict[str, Any] | None:
    v = [x for x in vals if x is not None]
    return {"median": med(v), "min": min(v), "max": max(v), "n": len(v), "each": v} if v else None


def chain_durations(at: dict[str, float | None]) -> dict[str, float]:
    """Each chain row's time since the previous chain row present in this run (the kill for the first)."""
    out, prev = {}, 0.0
    for key, _, chain in ROWS:
        if chain and at.get(key) is not None:
            out[key] = at[key] - prev  # type: ignore[operator]
            prev = at[key]  # type: ignore[assignment]
    return out


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"scenarios": {}}
    for scen in SCENARIOS:
        recs = [x for x in r["runs"] if x["scenario"] == scen]
        if not recs:
            continue
        out: dict[str, Any] = {"runs": len(recs), "at": {}, "phase": {}}
        for key, _, _ in ROWS:
            st = stats([x["at"].get(key) for x in recs])
            if st:
                out["at"][key] = st
            ph = stats([chain_durations(x["at"]).get(key) for x in recs])
            if ph:
                out["phase"][key] = ph
        for key in ("restore_s", "first_step_less_restore_s", "goal_s", "backoff_s", "first_step_dt",
                    "first_rank_created_s", "step_dt_median_s"):
            st = stats([x.get(key) for x in recs])
            if st:
                out[key] = st
        ck = [v for x in recs for v in x.get("ckpt_step_s", [])]
        if ck:
            ck.sort()
            out["ckpt_step_us"] = {"median": med(ck) * 1e6, "p90": ck[int(0.9 * (len(ck) - 1))] * 1e6, "n": len(ck)}
        met = [x.get("goal_met") for x in recs if x.get("goal_met") is not None]
        out["goal_met_runs"] = f"{sum(met)}/{len(met)}"
        out["goal_met"] = bool(met) and all(met)
        out["restored_steps"] = [x.get("restored_step") for x in recs]
        s["scenarios"][scen] = out
    sc = s["scenarios"]

    def m(scen: str, path: tuple[str, ...]) -> float | None:
        v: Any = sc.get(scen, {})
        for p in path:
            v = (v or {}).get(p)
        return v

    s["ratios_requeue_over_slurm_injob"] = {
        "first_step": ratio(m("slurm-requeue", ("at", "first_step", "median")),
                            m("slurm-injob", ("at", "first_step", "median"))),
        "first_step_less_restore": ratio(m("slurm-requeue", ("first_step_less_restore_s", "median")),
                                         m("slurm-injob", ("first_step_less_restore_s", "median"))),
    }
    s["ratio_slurm_over_local_injob_first_step"] = ratio(m("slurm-injob", ("at", "first_step", "median")),
                                                         m("local-injob", ("at", "first_step", "median")))
    return s


def print_report(r: dict[str, Any]) -> None:
    s = r["summary"]
    mch = r.get("machine", {})
    cfg = r["config"]
    print()
    print("== machine")
    print(f"  cpu {mch.get('cpu')}, {mch.get('usable_cores')}/{mch.get('cores')} cores, memory {mch.get('memory_gib')} GiB, "
          f"torch {mch.get('torch')}, python {mch.get('python')}, kernel {mch.get('kernel')}")
    print(f"  run dir {mch.get('target_dir')}: {mch.get('filesystem')}; load average at start "
          f"{mch.get('loadavg_at_start')}")
    print(f"  code measured: {r.get('code')}; git at start {r.get('git')}")
    print(f"== setup: 2 ranks (gloo), state {cfg['state_mib']:.0f} MiB per rank (params + 2 Adam moments, "
          f"replicated), step {cfg['step_s']} s, worker {cfg['worker']}; rounds: {cfg['repeats']} in-job, "
          f"{cfg['requeue_repeats']} requeue; Slurm {'on' if cfg['slurm'] else 'off'}"
          + (f" (cluster start {r['slurm_cluster_start_s']:.1f} s)" if r.get("slurm_cluster_start_s") else ""))
    bg = r.get("background_cpu_load", {})
    if bg:
        print("  cores other processes used in the second before each run: "
              + "; ".join(f"{k} {v}" for k, v in bg.items()))
    hb = r.get("heartbeat")
    print()
    if hb:
        print(f"== heartbeat (bench/bench_heartbeat.py, median of {hb['repeats']} x {hb['calls']} calls)")
        print(f"  beat() {hb['beat_us']:.3f} us per step; empty method call {fmt(hb['empty_call_us'], '.3f')} us; "
              f"control socket poll {fmt(hb['control_poll_us'], '.1f')} us; launcher read "
              f"{fmt(hb['launcher_read_us'], '.1f')} us per rank and second")
    for scen, out in s["scenarios"].items():
        ck = out.get("ckpt_step_us")
        if ck:
            step = (out.get("step_dt_median_s") or {}).get("median")
            print(f"  {scen}: ckpt.step() on steps without a save: median {ck['median']:.0f} us, p90 {ck['p90']:.0f} us "
                  f"({ck['n']} steps; the step is {fmt(step, '.3f', ' s')})")
    scens = list(s["scenarios"])
    if not scens:
        print("no runs")
    else:
        w = 22
        print()
        print("== time from the SIGKILL of rank 1 (s): median [each run]")
        print(f"{'':58s}" + "".join(f"{x:>{w}s}" for x in scens))
        for key, label, _ in ROWS:
            cells = [s["scenarios"][x]["at"].get(key) for x in scens]
            if not any(cells):
                continue
            print(f"{label:58s}" + "".join(f"{'' if c is None else fmt(c['median'], '.3f'):>{w}s}" for c in cells))
        print()
        print("== phases (s): median time since the previous row of this table")
        print(f"{'':58s}" + "".join(f"{x:>{w}s}" for x in scens))
        for key, label, chain in ROWS:
            if not chain:
                continue
            cells = [s["scenarios"][x]["phase"].get(key) for x in scens]
            if not any(cells):
                continue
            print(f"{label:58s}" + "".join(f"{'' if c is None else fmt(c['median'], '.3f'):>{w}s}" for c in cells))
        print()
        print(f"== goal: the first step after the resume within {GOAL_S:.0f} s + the restore time")
        for scen in scens:
            out = s["scenarios"][scen]
            fs = out["at"].get("first_step")
            rs = out.get("restore_s")
            fl = out.get("first_step_less_restore_s")
            if fs is None or rs is None:
                print(f"  {scen}: n/a")
                continue
            print(f"  {scen}: first step {fs['median']:.2f} s (max {fs['max']:.2f}); restore {rs['median']:.2f} s; "
                  f"without the restore {fl['median']:.2f} s (max {fl['max']:.2f}) -> "
                  f"{'MET' if out['goal_met'] else 'MISSED'} in {out['goal_met_runs']} runs")
        rq = s["ratios_requeue_over_slurm_injob"]
        if rq["first_step"] is not None:
            print(f"  requeue / in-job (Slurm), first step after the resume: {rq['first_step']:.2f}x; "
                  f"without the restore: {fmt(rq['first_step_less_restore'], '.2f')}x")
        if s["ratio_slurm_over_local_injob_first_step"] is not None:
            print(f"  Slurm in-job / local in-job: {s['ratio_slurm_over_local_injob_first_step']:.2f}x")
    print()
    print("per run (s from the kill):")
    for rec in r["runs"]:
        at = rec["at"]
        parts = " ".join(f"{k}={v:.3f}" for k, v in at.items() if v is not None)
        print(f"  {rec['scenario']}/{rec['round']}: {parts} restore_s={fmt(rec.get('restore_s'), '.3f')} "
              f"crash_step={rec.get('crash_step')} restored_step={rec.get('restored_step')}"
              + (f" backoff={rec['backoff_s']} outcome={rec.get('restart_outcome')}" if "backoff_s" in rec else "")
              + (f" decision={rec['decision']}" if rec.get("decision") else "")
              + (f" exit={rec['exit_code']}" if "exit_code" in rec else "")
              + (f" states={rec['job_states']}" if rec.get("job_states") else "")
              + (f" steps_launched={rec['step_launches']}" if rec.get("step_launches") else "")
              + (f" peer_error={rec['peer_errors']}" if rec.get("peer_errors") else ""))
    for n in r.get("notes", []):
        print(f"note: {n}")
    for p in r["problems"]:
        print(f"PROBLEM: {p}")
    for k, v in r["errors"].items():
        print(f"ERROR in {k}: {v}")


QUICK = {"repeats": 1, "requeue_repeats": 1, "state_mib": 48.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each in-job scenario")
    ap.add_argument("--requeue-repeats", type=int, default=3, help="runs of the requeue scenario")
    ap.add_argument("--no-slurm", dest="slurm", action="store_false",
                    help="only the local scenario (the Slurm ones need root and tests/slurm/install.sh)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one run of each scenario, a smaller state (overrides the defaults: {QUICK})")
    ap.add_argument("--state-mib", type=float, default=192.0,
                    help="each rank's state, MiB: params + 2 Adam moments (192 = 64 MiB of parameters)")
    ap.add_argument("--step-s", type=float, default=0.1, help="the worker's training step")
    ap.add_argument("--code", choices=("head", "worktree"), default="head",
                    help="head: a git archive of HEAD (the worker from the working tree); worktree: as it is")
    ap.add_argument("--run-timeout", type=float, default=240.0, help="limit for one run, seconds")
    ap.add_argument("--dir", default=None, help="parent of the run directory (default /tmp; removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs) for inspection")
    ap.add_argument("--json", default=None, help="write every number here as JSON")
    add_wait_quiet_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if args.slurm:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from slurm_cluster import missing_tools

        missing = missing_tools()
        if os.geteuid() != 0 or missing:
            raise SystemExit("the Slurm scenarios start a private Slurm cluster whose daemons run as root: run as "
                             "root with Slurm installed (tests/slurm/install.sh)"
                             + (f"; missing {', '.join(missing)}" if missing else "") + ", or pass --no-slurm")
    r = run_main(args, Bench, print_report)
    return 1 if r["errors"] or r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
