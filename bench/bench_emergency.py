"""Emergency checkpoint benchmark: stop signal -> committed checkpoint, and -> requeue, against the budget.

    .venv/bin/python bench/bench_emergency.py [--size-gib 1.0] [--repeats 3] [--step-s 0.05] [--slurm]
                                              [--modes cold,warm,restored] [--settle-s 3] [--dir DIR]
                                              [--json OUT] [--wait-quiet S]

A training program (bench/emergency_worker.py: ~``--size-gib`` of model + Adam state, a fixed step of
``--step-s``) runs under ``rslurm launch``. Once it has trained ``--settle-s`` seconds (and at least 5
steps), the launcher gets a stop signal; the launcher's records in the run's ``events.jsonl`` and the
worker's own log give the latencies:

* local (``rslurm launch -n 1 -- python bench/emergency_worker.py``): SIGTERM to the launcher, which must
  exit 75 after the emergency commit;
* ``--slurm`` (root; a private 2-node cluster from tests/slurm_cluster.py): a batch job
  ``exec rslurm launch -- srun -N1 -n1 python bench/emergency_worker.py`` submitted with ``--requeue`` gets
  ``scancel --batch --signal=USR1``; the launcher must save, then call ``scontrol requeue``, and the job
  must go back to PENDING. The requeued job is cancelled.

Modes: ``cold`` = the emergency save is the process's first save and nothing was restored (it allocates
the staging buffer); ``warm`` = one blocking save at step 1 came first, as in a job with periodic
checkpoints; ``restored`` = the emergency save is the first save of a process that restored a committed
step at start, as in a job requeued after a preemption and preempted again before its first interval save.
For ``restored``, a priming run (the same launch, worker ``--save-and-exit``: a few steps, one blocking
save, exit 0; under Slurm a job pinned to the same node) first commits a step in the same local dir and
run id; its ``events.jsonl`` is moved aside. The measured worker (``--expect-restore``) then
restores that step; ``Checkpointer.restore()`` plans the save and allocates + pre-faults the staging
buffer on its writer thread in the background, and the worker logs how long ``restore()`` took, when
training started and when that background allocation finished.

Baselines in the same run, on the same directory, in rounds that rotate the order of the methods: raw
write + fsync of the state's byte count from a page-aligned buffer (O_DIRECT where the filesystem allows,
best of 1 and ``--io-threads`` threads) and ``torch.save`` + fsync of the same state. The budget is the
issue's: one training step + 1.2 x (state bytes / raw write bandwidth) + 1 s. Times are medians.
See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

from common import (  # noqa: E402
    GB,
    BenchBase,
    add_wait_quiet_arg,
    best_gbps,
    build_state,
    describe,
    fmt,
    git_facts,
    machine_facts,
    med,
    now,
    raw_write,
    read_jsonl,
    release_memory,
    remove,
    run_main,
    state_dict_of,
    tail,
    torch_save_fsync,
)

PY = sys.executable
WORKER = os.path.join(HERE, "emergency_worker.py")
REQUEUE_EXIT_CODE = 75  # rslurm launch, local mode, stopped by a signal: "run again to resume"
MODES = ("cold", "warm", "restored")



def launcher_events(path: str) -> list[dict[str, Any]]:
    """The launcher's records in a run's event log (the ranks write to the same file)."""
    return [e for e in read_jsonl(path) if e.get("source") == "launcher"]


def first(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == kind), None)



class Bench(BenchBase):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, "rslurm-bench-emergency-")
        self.r: dict[str, Any] = {"errors": {}, "problems": [], "runs": []}

    def problem(self, msg: str) -> None:
        self.log("PROBLEM: " + msg)
        self.r["problems"].append(msg)

    # ---------------------------------------------------------------- setup and baselines
    def setup(self) -> None:
        want = int(self.args.size_gib * 2**30)
        self.log(f"building state of ~{want / 2**30:.2f} GiB for the baselines (untimed) ...")
        self.model, self.opt = build_state(want, seed=1)
        self.r["state"] = describe(state_dict_of(self.model, self.opt))
        self.nbytes = self.r["state"]["bytes"]
        self.r["machine"] = machine_facts(self.root)
        self.r["git"] = git_facts()
        self.check_free(4 * self.nbytes)

    def measured(self, name: str, fn: Callable[[int], None], i: int) -> None:
        def done(dt: float, load: float | None) -> None:
            who = "other processes, the launched job included" if name.startswith(("local", "slurm")) else \
                "other processes"
            self.log(f"round {i} {name}: {dt:.1f}s (CPU of {who}: {load:.2f} cores)")

        # keep going: one broken method must not hide the others
        self.guarded(name, lambda: fn(i), done, error_list=True)

    def raw_round(self, i: int) -> None:
        mv = self.raw_buffer()
        path = os.path.join(self.root, "raw.bin")
        for threads in sorted({1, self.args.io_threads}):
            remove(path)
            dt, direct = raw_write(path, mv, threads)
            self.add("raw", f"write_t{threads}_s", dt)
            self.r["raw"]["o_direct"] = direct
        remove(path)
        self.r["raw"]["bytes"] = len(mv)

    def torch_round(self, i: int) -> None:
        path = os.path.join(self.root, "torch_save.pt")
        remove(path)
        sd = state_dict_of(self.model, self.opt)
        self.add("torch", "save_fsync_s", torch_save_fsync(path, sd))
        remove(path)

    # ---------------------------------------------------------------- the worker under the launcher
    def worker_env(self, local_dir: str, run_id: str) -> dict[str, str]:
        # A private control-socket directory: the default (<tmp>/rslurm-<uid>/run/<job id>.<node>.sock) is
        # shared by every private test cluster on this host, and their job ids all start at 1.
        env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RSLURM_LOCAL_DIR": local_dir, "RSLURM_RUN_ID": run_id,
               "RSLURM_LOG_LEVEL": "INFO", "RSLURM_CONTROL_DIR": os.path.join(self.root, "ctl")}
        if self.args.ranks_io_threads is not None:
            env["RSLURM_IO_THREADS"] = str(self.args.ranks_io_threads)
        return env

    def worker_argv(self, wlog: str, mode: str, prime: bool = False) -> list[str]:
        """The worker's command line; ``prime``: the priming run of ``restored`` (save once, exit 0)."""
        a = [PY, WORKER, "--size-gib", str(self.args.size_gib), "--step-s", str(self.args.step_s), "--log", wlog]
        if prime:
            return a + ["--save-and-exit"]
        a += ["--ready-s", str(self.args.settle_s)]
        return a + {"warm": ["--prime-save"], "restored": ["--expect-restore"]}.get(mode, [])

    def set_prime_events_aside(self, pattern: str) -> None:
        """The priming run's launcher events would be read as the measured run's: move them aside."""
        for path in glob.glob(pattern):
            os.replace(path, path.removesuffix(".jsonl") + ".prime.jsonl")

    def prime_facts(self, rec: dict[str, Any], plog: str, t0: float) -> None:
        saved = first(read_jsonl(plog), "saved")
        rec["priming_run_wall_s"] = now() - t0
        if saved is not None:
            rec["priming_run_step"] = saved.get("step")
            rec["priming_run_save_s"] = saved.get("save_s")

    def wait_ready(self, wlog: str, alive: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("event") == "ready" for e in read_jsonl(wlog)):
                return
            if not alive():
                raise RuntimeError(f"the worker's launcher ended before the worker was ready ({wlog})")
            time.sleep(0.1)
        raise RuntimeError(f"worker not ready after {timeout:.0f}s ({wlog})")

    def analyse(self, where: str, mode: str, i: int, events: list[dict[str, Any]], wlog: list[dict[str, Any]],
                t_sent: float) -> dict[str, Any]:
        """Latencies of one run, all from the signal's arrival at the launcher (``signal.at``)."""
        rec: dict[str, Any] = {"where": where, "mode": mode, "round": i}
        sig = first(events, "signal")
        if sig is None:
            self.problem(f"{where}/{mode}/{i}: no 'signal' event in events.jsonl")
            return rec
        at = float(sig["at"])
        rec["signal_source"] = sig.get("signal")
        rec["delivery_s"] = at - t_sent
        for kind, key in (("save_requested", "signal_to_save_requested_s"), ("ranks_exited", "signal_to_ranks_exited_s"),
                          ("decision", "signal_to_decision_s")):
            e = first(events, kind)
            if e is not None:
                rec[key] = e["t"] - at
        c = first(events, "committed")
        if c is None:
            self.problem(f"{where}/{mode}/{i}: no 'committed' event in events.jsonl")
        else:
            rec["signal_to_commit_s"] = c.get("after_signal_s")
            rec["committed_step"] = c.get("step")
        q = first(events, "requeue_call")
        if q is not None:
            rec["signal_to_requeue_call_s"] = q.get("after_signal_s")
        d = first(events, "decision")
        if d is not None:
            rec["decision"] = {k: d.get(k) for k in ("action", "rule", "outcome", "committed_step")}
        steps = [e["dt"] for e in wlog if e.get("event") == "step"]
        rec["step_s"] = med(steps)
        rec["step_s_max"] = max(steps) if steps else None
        b = first(wlog, "built")
        if b is not None:
            rec["worker_state_bytes"] = b.get("bytes")
            rec["worker_build_s"] = b.get("build_s")
        p = first(wlog, "primed")
        if p is not None:
            rec["prime_save_s"] = p.get("save_s")
        rs = first(wlog, "restored")
        if rs is not None:
            rec["restored_step"] = rs.get("step")
            rec["worker_restore_s"] = rs.get("restore_s") if rs.get("step") else None
        tr = first(wlog, "training")
        if tr is not None:
            rec["training_before_signal_s"] = at - tr["t"]
        if mode == "restored" and not (rs or {}).get("step"):
            self.problem(f"{where}/{mode}/{i}: the worker restored nothing")
        em = first(wlog, "emergency")
        if em is None:
            self.problem(f"{where}/{mode}/{i}: the worker logged no emergency save")
        else:
            rec["signal_to_step_boundary_s"] = em["t_call"] - at
            rec["rank_save_s"] = em["save_s"]  # stall + write + commit (+ retention) on the training thread
            rec["rank_stall_s"] = em.get("stall_s")
            rec["rank_write_s"] = em.get("write_s")
            rec["rank_commit_phase_s"] = em.get("commit_phase_s")
            rec["rank_bytes_written"] = em.get("bytes_written")
            rec["signal_to_rank_save_returned_s"] = em["t_return"] - at
            if em.get("prepared_done_t") is not None and rs is not None:
                # restore() returned just before the 'restored' line: this is the background allocation's time
                rec["prepared_after_restore_s"] = em["prepared_done_t"] - rs["t"]
                rec["prepared_before_signal"] = em["prepared_done_t"] < at
            elif mode == "restored":
                self.problem(f"{where}/{mode}/{i}: the worker saw no background staging allocation")
            ex = first(wlog, "exit")
            if ex is not None:  # after ckpt.close(); the interpreter's own shutdown (torch) follows
                rec["signal_to_worker_closed_s"] = ex["t"] - at
            if rec.get("signal_to_commit_s") is not None:
                rec["launcher_notice_lag_s"] = rec["signal_to_commit_s"] - rec["signal_to_rank_save_returned_s"]
        return rec

    def run_local(self, mode: str, i: int) -> None:
        d = os.path.join(self.root, f"local-{mode}-{i}")
        os.makedirs(d)
        wlog = os.path.join(d, "worker.jsonl")
        out_path = os.path.join(d, "launcher.out")
        env = {**os.environ, **self.worker_env(os.path.join(d, "nvme", "%n"), "bench")}
        events_glob = os.path.join(d, "nvme", "*", "bench", "events.jsonl")
        prime: dict[str, Any] = {}
        if mode == "restored":  # a first incarnation that commits a step and ends normally
            plog = os.path.join(d, "prime.jsonl")
            t0 = now()
            with open(os.path.join(d, "prime.out"), "wb") as out:
                cp = subprocess.run([PY, "-m", "resilient_slurm.cli", "launch", "-n", "1", "--",
                                     *self.worker_argv(plog, mode, prime=True)], env=env, cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=300)
            if cp.returncode != 0:
                raise RuntimeError(f"priming run exited {cp.returncode}:\n{tail(os.path.join(d, 'prime.out'))}")
            self.prime_facts(prime, plog, t0)
            self.set_prime_events_aside(events_glob)
        cmd = [PY, "-m", "resilient_slurm.cli", "launch", "-n", "1", "--", *self.worker_argv(wlog, mode)]
        with open(out_path, "wb") as out:
            p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                self.wait_ready(wlog, lambda: p.poll() is None, timeout=180)
                time.sleep(random.uniform(0, self.args.step_s))  # land anywhere in a step
                t_sent = time.time()
                os.kill(p.pid, signal.SIGTERM)
                try:
                    rc = p.wait(timeout=self.args.stop_timeout)
                except subprocess.TimeoutExpired:
                    self.problem(f"local/{mode}/{i}: launcher still running {self.args.stop_timeout:.0f}s after "
                                 f"SIGTERM; killed. Output tail:\n{tail(out_path)}")
                    raise
                t_exit = time.time()
            finally:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
        events = launcher_events(next(iter(glob.glob(events_glob)), ""))
        rec = self.analyse("local", mode, i, events, read_jsonl(wlog), t_sent)
        rec.update(prime)
        rec["exit_code"] = rc
        sig = first(events, "signal")
        if sig is not None:
            rec["signal_to_launcher_exit_s"] = t_exit - float(sig["at"])
        if rc != REQUEUE_EXIT_CODE:
            self.problem(f"local/{mode}/{i}: launcher exited {rc}, expected {REQUEUE_EXIT_CODE}. "
                         f"Output tail:\n{tail(out_path)}")
        self.r["runs"].append(rec)
        self.log(f"local/{mode}/{i}: signal->commit {rec.get('signal_to_commit_s')}, exit {rc}")
        remove(os.path.join(d, "nvme"))

    # ---------------------------------------------------------------- Slurm
    def slurm_phase(self) -> None:
        sys.path.insert(0, os.path.join(REPO, "tests"))
        from slurm_cluster import SlurmCluster

        c = SlurmCluster()
        t0 = now()
        c.start()
        self.log(f"Slurm test cluster up in {now() - t0:.1f}s ({c.root})")
        try:
            for i in range(self.args.slurm_repeats):
                for mode in self.modes[i % len(self.modes):] + self.modes[: i % len(self.modes)]:
                    self.measured(f"slurm-{mode}", lambda i, mode=mode: self.run_slurm(c, mode, i), i)
        finally:
            c.stop()

    def run_slurm(self, c: Any, mode: str, i: int) -> None:
        d = os.path.join(self.root, f"slurm-{mode}-{i}")
        os.makedirs(d)
        wlog = os.path.join(d, "worker.jsonl")
        out_path = os.path.join(d, "job.out")
        run_id = f"bench-{mode}-{i}"
        env = self.worker_env(os.path.join(d, "nvme", "%n"), run_id)
        exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())

        def script(argv: list[str]) -> str:
            launch = " ".join([PY, "-m", "resilient_slurm.cli", "launch", "--", "srun", "-N1", "-n1", *argv])
            return f"#!/bin/bash\n{exports}cd {REPO}\nexec {launch}\n"

        events_glob = os.path.join(d, "nvme", "*", run_id, "events.jsonl")
        pin: list[str] = []
        prime: dict[str, Any] = {}
        if mode == "restored":  # a first job that commits a step and completes; the measured job restores it
            pin = ["-w", c.nodes[0]]  # the same node, so the same node-local directory
            plog = os.path.join(d, "prime.jsonl")
            t0 = now()
            pjob = c.sbatch(script(self.worker_argv(plog, mode, prime=True)), "-p", "low", "-N1", "-n1", *pin,
                            "-o", os.path.join(d, "prime.out"), "-J", "emerg-prime")
            try:
                c.wait_state(pjob, "COMPLETED", timeout=300)
                c.wait_queue_empty(timeout=60)
            except Exception:
                self.problem(f"slurm/{mode}/{i}: priming job {pjob} failed:\n{tail(os.path.join(d, 'prime.out'))}")
                raise
            self.prime_facts(prime, plog, t0)
            self.set_prime_events_aside(events_glob)
        job = c.sbatch(script(self.worker_argv(wlog, mode)), "-p", "low", "--requeue", "-N1", "-n1", *pin,
                       "--open-mode=append", "-o", out_path, "-J", f"emerg-{mode}")

        def alive() -> bool:
            info = c.job_info(job)
            return info is not None and info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")

        def events() -> list[dict[str, Any]]:
            return launcher_events(next(iter(glob.glob(events_glob)), ""))

        try:
            self.wait_ready(wlog, alive, timeout=180)
            time.sleep(random.uniform(0, self.args.step_s))
            t_sent = time.time()
            c.run(["scancel", "--batch", "--signal=USR1", str(job)], timeout=15)
            seen: dict[str, float] = {}  # JobState -> first time polled in that state
            polls = 0
            restarts = reason = None
            deadline = time.monotonic() + self.args.stop_timeout
            decided = False
            while time.monotonic() < deadline:
                if not decided:
                    # Cheap file reads only while the rank saves: scontrol would take CPU from the save.
                    decided = first(events(), "decision") is not None
                    if not decided:
                        time.sleep(0.02)
                        continue
                t_poll = time.time()
                info = c.job_info(job)
                polls += 1
                st = info.get("JobState") if info else "GONE"
                seen.setdefault(st, t_poll)
                if st in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
                    restarts = info.get("Restarts") if info else None
                    reason = info.get("Reason") if info else None
                    break
                if st in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
                    raise RuntimeError(f"job {job} ended {st} instead of being requeued")
                time.sleep(self.args.poll_s)
            else:
                raise RuntimeError(f"job {job} not requeued within {self.args.stop_timeout:.0f}s of the signal")
        except Exception:
            self.problem(f"slurm/{mode}/{i}: job {job} failed the scenario. Events: {events()}\n"
                         f"job output tail:\n{tail(out_path)}")
            raise
        finally:
            with contextlib.suppress(Exception):
                c.scancel(job)
            with contextlib.suppress(Exception):
                c.wait_queue_empty(timeout=60)
        ev = events()
        rec = self.analyse("slurm", mode, i, ev, read_jsonl(wlog), t_sent)
        rec.update(prime)
        sig = first(ev, "signal")
        if sig is not None:
            at = float(sig["at"])
            rec["job_states_seen_s"] = {k: v - at for k, v in seen.items()}
            back = [v for k, v in seen.items() if k in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")]
            rec["signal_to_pending_s"] = min(back) - at if back else None
        rec["scontrol_polls"] = polls
        rec["restarts"] = restarts
        rec["pending_reason"] = reason
        if (rec.get("decision") or {}).get("action") != "requeue":
            self.problem(f"slurm/{mode}/{i}: decision {rec.get('decision')}, expected requeue")
        if first(ev, "requeue_call") is None:
            self.problem(f"slurm/{mode}/{i}: no 'requeue_call' event")
        self.r["runs"].append(rec)
        self.log(f"slurm/{mode}/{i}: signal->commit {rec.get('signal_to_commit_s')}, ->requeue_call "
                 f"{rec.get('signal_to_requeue_call_s')}, ->PENDING {rec.get('signal_to_pending_s')}")
        remove(os.path.join(d, "nvme"))

    # ---------------------------------------------------------------- main
    def run(self) -> dict[str, Any]:
        self.modes = [m for m in self.args.modes.split(",") if m]
        for m in self.modes:
            if m not in MODES:
                raise SystemExit(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
        try:
            self.setup()
            methods: list[tuple[str, Callable[[int], None]]] = [("raw", self.raw_round), ("torch", self.torch_round)]
            if self.args.local:
                methods += [(f"local-{m}", lambda i, m=m: self.run_local(m, i)) for m in self.modes]
            for i in range(self.repeats):
                k = i % len(methods)
                for name, fn in methods[k:] + methods[:k]:
                    self.measured(name, fn, i)
            self.free_raw_buffer()
            del self.model, self.opt
            release_memory()
            if self.args.slurm:
                try:
                    self.slurm_phase()
                except Exception as exc:
                    import traceback

                    traceback.print_exc()
                    self.r["errors"].setdefault("slurm", []).append(f"{type(exc).__name__}: {exc}")
        finally:
            if self.args.keep:
                self.log(f"kept {self.root}")
            else:
                shutil.rmtree(self.root, ignore_errors=True)
        end = git_facts()
        if end.get("sources_sha256") != self.r.get("git", {}).get("sources_sha256"):
            # Every launch imports the library from the working tree: a commit or an edit during the run
            # means the runs did not all measure the same code.
            self.problem(f"the code changed during the run: {self.r.get('git')} at the start, {end} at the end")
        self.r["git_at_end"] = end
        raw = self.r.get("raw", {})
        raw["write_gbps"] = best_gbps(raw, "write")
        self.r["config"] = {k: getattr(self.args, k) for k in ("size_gib", "repeats", "slurm_repeats", "step_s",
                                                                 "io_threads", "ranks_io_threads", "modes", "poll_s",
                                                                 "settle_s")}
        self.r["summary"] = summarize(self.r)
        return self.r


# --------------------------------------------------------------------------------------------- report

METRICS = [
    ("signal_to_step_boundary_s", "signal -> rank at its next step boundary"),
    ("rank_save_s", "  rank's blocking emergency save (stall+write+commit)"),
    ("rank_stall_s", "    of which stall (plan, staging alloc, copy)"),
    ("rank_write_s", "    of which shard write (writer thread)"),
    ("signal_to_commit_s", "signal -> committed (launcher event)"),
    ("signal_to_ranks_exited_s", "signal -> ranks exited"),
    ("signal_to_launcher_exit_s", "signal -> launcher exited (local)"),
    ("signal_to_requeue_call_s", "signal -> scontrol requeue issued"),
    ("signal_to_pending_s", "signal -> job PENDING again (scontrol poll)"),
    ("training_before_signal_s", "(before the signal) training time"),
    ("worker_restore_s", "(before the signal) restore() at start"),
    ("prepared_after_restore_s", "(before) background staging done after restore()"),
]


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    n = r.get("state", {}).get("bytes")
    s: dict[str, Any] = {"state_bytes": n}
    s["raw_write_gbps"] = r.get("raw", {}).get("write_gbps")
    s["torch_save_fsync_s"] = med(r.get("torch", {}).get("save_fsync_s", []))
    s["step_s"] = med([x.get("step_s") for x in r["runs"]])
    s["state_write_s"] = n / (s["raw_write_gbps"] * GB) if n and s["raw_write_gbps"] else None
    s["budget_s"] = (s["step_s"] + 1.2 * s["state_write_s"] + 1.0
                     if s["step_s"] is not None and s["state_write_s"] is not None else None)
    by_group: dict[str, list[dict[str, Any]]] = {}
    for rec in r["runs"]:
        by_group.setdefault(f"{rec['where']}/{rec['mode']}", []).append(rec)
    s["groups"] = {}
    for g, recs in by_group.items():
        out: dict[str, Any] = {"runs": len(recs)}
        for key, _ in METRICS:
            vals = [x[key] for x in recs if x.get(key) is not None]
            if vals:
                out[key] = {"median": med(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        for key in ("signal_to_commit_s", "signal_to_requeue_call_s", "signal_to_pending_s"):
            m = (out.get(key) or {}).get("median")
            if m is not None and s["budget_s"]:
                worst = out[key]["max"]
                out[key]["over_budget"] = m / s["budget_s"]
                out[key]["met"] = worst <= s["budget_s"]
            if m is not None and s["torch_save_fsync_s"] and key == "signal_to_commit_s":
                out[key]["over_torch_save"] = m / s["torch_save_fsync_s"]
        out["exit_codes"] = [x.get("exit_code") for x in recs if "exit_code" in x]
        out["decisions"] = [(x.get("decision") or {}).get("action") for x in recs if x.get("decision")]
        s["groups"][g] = out
    return s


def print_report(r: dict[str, Any]) -> None:
    s = r["summary"]
    m = r.get("machine", {})
    st = r.get("state", {})
    cfg = r["config"]
    print()
    print("== machine")
    print(f"  cpu {m.get('cpu')}, {m.get('usable_cores')}/{m.get('cores')} cores, memory {m.get('memory_gib')} GiB, "
          f"torch {m.get('torch')}")
    print(f"  target {m.get('target_dir')}: {m.get('filesystem')}; git {r.get('git')}")
    print("== state")
    if st:
        print(f"  {st['bytes'] / 2**30:.3f} GiB in {st['tensors']} tensors (model + Adam moments); "
              f"rounds {cfg['repeats']} local, {cfg['slurm_repeats']} Slurm; modes {cfg['modes']}; "
              f"step {cfg['step_s']} s requested")
    raw = r.get("raw", {})
    print()
    print(f"{'baseline (median)':58s} {'time':>10s}")
    print("-" * 72)
    for k in sorted(raw):
        if k.startswith("write_t"):
            mode = "O_DIRECT" if raw.get("o_direct") else "buffered"
            print(f"{'raw ' + mode + ' write + fsync, ' + k[7:-2] + ' thread(s)':58s} {fmt(med(raw[k]), '.3f', ' s'):>10s}")
    print(f"{'torch.save + fsync':58s} {fmt(s['torch_save_fsync_s'], '.3f', ' s'):>10s}")
    print(f"{'training step (worker, median)':58s} {fmt(s['step_s'], '.3f', ' s'):>10s}")
    bw = s["raw_write_gbps"]
    print(f"raw write bandwidth (best) {bw:.3f} GB/s" if bw else "raw write bandwidth n/a")
    if s["budget_s"] is not None:
        print(f"BUDGET = step {s['step_s']:.3f} + 1.2 x {s['state_write_s']:.3f} (state / raw write) + 1 s "
              f"= {s['budget_s']:.3f} s")
    for g, out in s["groups"].items():
        print()
        print(f"== {g} ({out['runs']} runs)" + (f"; launcher exit codes {out['exit_codes']}" if out["exit_codes"] else "")
              + (f"; decisions {out['decisions']}" if out["decisions"] else ""))
        print(f"{'latency':50s} {'median':>9s} {'min':>9s} {'max':>9s} {'/budget':>8s} {'/torch.save':>11s}")
        for key, label in METRICS:
            v = out.get(key)
            if not v:
                continue
            ob = v.get("over_budget")
            ot = v.get("over_torch_save")
            met = v.get("met")
            print(f"{label:50s} {v['median']:9.3f} {v['min']:9.3f} {v['max']:9.3f} "
                  f"{'' if ob is None else f'{ob:8.2f}':>8s} {'' if ot is None else f'{ot:11.2f}':>11s}"
                  + ("" if met is None else ("  MET (max <= budget)" if met else "  MISSED (max > budget)")))
    print()
    print("per run:")
    keys = ["signal_to_step_boundary_s", "rank_save_s", "rank_stall_s", "signal_to_commit_s", "launcher_notice_lag_s",
            "signal_to_worker_closed_s", "signal_to_ranks_exited_s", "signal_to_launcher_exit_s",
            "signal_to_requeue_call_s", "signal_to_pending_s", "worker_restore_s", "prepared_after_restore_s"]
    for rec in r["runs"]:
        parts = " ".join(f"{k.replace('signal_to_', '->').removesuffix('_s')}={rec[k]:.3f}" for k in keys
                         if rec.get(k) is not None)
        print(f"  {rec['where']}/{rec['mode']}/{rec['round']}: {parts} step={rec.get('step_s') or 0:.3f}"
              + (f" exit={rec['exit_code']}" if "exit_code" in rec else "")
              + (f" restored_step={rec['restored_step']} prepared_before_signal={rec.get('prepared_before_signal')}"
                 if rec.get("restored_step") else "")
              + (f" states={ {k: round(v, 3) for k, v in rec['job_states_seen_s'].items()} }"
                 if rec.get("job_states_seen_s") else ""))
    for p in r["problems"]:
        print(f"PROBLEM: {p}")
    for k, v in r["errors"].items():
        print(f"ERROR in {k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size: params + 2 Adam moments")
    ap.add_argument("--repeats", type=int, default=3, help="local rounds (each: raw, torch.save, every mode)")
    ap.add_argument("--slurm", action="store_true", help="also measure under a private Slurm cluster (root)")
    ap.add_argument("--no-local", dest="local", action="store_false", help="skip the local launcher runs")
    ap.add_argument("--slurm-repeats", type=int, default=2, help="Slurm rounds (each: every mode)")
    ap.add_argument("--modes", default="cold,warm,restored",
                    help="cold (first save of the process), warm (after one save), restored (first save after a "
                         "restore at start)")
    ap.add_argument("--settle-s", type=float, default=3.0,
                    help="seconds the worker trains (and at least 5 steps) before the signal, in every mode")
    ap.add_argument("--step-s", type=float, default=0.05, help="the worker's training step")
    ap.add_argument("--io-threads", type=int, default=4, help="threads of the multi-thread raw write")
    ap.add_argument("--ranks-io-threads", type=int, default=None,
                    help="RSLURM_IO_THREADS for the worker (default: the library's)")
    ap.add_argument("--poll-s", type=float, default=0.02, help="scontrol poll interval after the decision")
    ap.add_argument("--stop-timeout", type=float, default=120.0, help="how long a run may take after the signal")
    ap.add_argument("--dir", default=None, help="parent of the run directory (default /tmp; removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs) for inspection")
    ap.add_argument("--json", default=None, help="write every number here as JSON")
    add_wait_quiet_arg(ap)
    args = ap.parse_args(argv)
    if args.slurm and os.geteuid() != 0:
        raise SystemExit("--slurm starts a private Slurm cluster whose daemons run as root: run as root")
    r = run_main(args, Bench, print_report)
    return 1 if r["errors"] or r["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
