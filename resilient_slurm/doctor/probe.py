"""``rslurm doctor``, group ``signals``: does the save signal reach a process on every node of the job,
the way the launcher sends it; and can this node hold the launcher's control socket.

Two roles in one module:

* **The probe task** (``python -m resilient_slurm.doctor.probe --signal USR2``), run as one job step with
  one task per node. It reports how it found the signal (default, ignored, blocked: a rank's
  ``Checkpointer`` traps only a signal left at its default), installs a handler like a rank does (the
  handler only sets a flag), prints a ``ready`` JSON line, and prints ``received`` when the signal comes,
  or ``timeout``. Standard library only: it starts in a fraction of a second.
* **The driver** (:func:`probe_signal_delivery`, called by :func:`check` inside an allocation): starts
  the step with ``srun --overlap --ntasks-per-node=1``, waits until every node's task is ready, sends the
  signal to that step with ``scancel --signal=<sig> <job>.<step>`` (:meth:`SlurmClient.signal`, as the
  launcher does for ranks on other nodes), waits for every node's ``received`` line, and tears the step
  down whatever happened.

Call order: :func:`resilient_slurm.doctor.run_checks` calls :func:`check` last; it runs
:func:`check_control_dir` anywhere and the delivery probe only inside an allocation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..jobenv import JobEnv  # standard library only, like the rest of what this module imports

# Only the standard library at import time: the probe task imports this module on every node (after the
# package's __init__, which keeps to the standard library, config, errors and jobenv too).
if TYPE_CHECKING:
    from .context import DoctorContext, Finding


# ---------------------------------------------------------------------------------------------- probe task
def _status_mask(field_name: str) -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def _emit(event: str, **fields: Any) -> None:
    node = JobEnv.from_env().node_name or socket.gethostname()
    print(json.dumps({"event": event, "node": node, "t": time.time(), **fields}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The probe task: report readiness, wait for the signal, report receipt (exit 0) or timeout (3)."""
    ap = argparse.ArgumentParser(prog="python -m resilient_slurm.doctor.probe",
                                 description="rslurm doctor's signal probe (one task per node)")
    ap.add_argument("--signal", required=True, help="signal name to wait for (USR2)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it")
    args = ap.parse_args(argv)
    num = int(getattr(signal, "SIG" + args.signal.upper().removeprefix("SIG")))
    current = signal.getsignal(num)
    inherited = ("default" if current is signal.SIG_DFL else "ignored" if current is signal.SIG_IGN
                 else "handler")
    blocked = bool(_status_mask("SigBlk") >> (num - 1) & 1)
    got: list[float] = []

    def handler(signum: int, frame: object) -> None:
        got.append(time.time())  # a flag, as a rank's handler sets

    signal.signal(num, handler)
    raw = JobEnv.from_env().raw  # reported as given, the malformed included
    _emit("ready", pid=os.getpid(), job=raw.get("SLURM_JOB_ID"), step=raw.get("SLURM_STEP_ID"),
          procid=raw.get("SLURM_PROCID"), signal=args.signal, inherited=inherited, blocked=blocked)
    deadline = time.monotonic() + args.timeout
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)  # interrupted by the signal; the handler runs between sleeps
    if got:
        _emit("received", signal=args.signal, at=got[0])
        return 0
    _emit("timeout", signal=args.signal)
    return 3


# ---------------------------------------------------------------------------------------------- driver
@dataclass
class ProbeResult:
    """What the probe step reported."""

    nodes: list[str]                                  # the nodes asked
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)  # node -> seconds from scancel to receipt
    step: str | None = None
    error: str | None = None
    srun_stderr: str = ""

    @property
    def missing(self) -> list[str]:
        """Nodes that did not report the signal."""
        return [n for n in self.nodes if n not in self.received]


def probe_signal_delivery(slurm: Any, job_id: str, nodes: Sequence[str], sig: str, *,
                          start_timeout: float = 60.0, signal_timeout: float = 15.0,
                          env: dict[str, str] | None = None) -> ProbeResult:
    """Run the probe step on ``nodes`` of ``job_id``, signal it through Slurm, and collect the reports."""
    n = len(nodes)
    res = ProbeResult(nodes=list(nodes))
    from ..slurm.client import per_node_step  # here: the probe task itself imports the standard library only

    cmd = per_node_step(n, "rslurm-doctor", sys.executable, "-m", "resilient_slurm.doctor.probe",
                        "--signal", sig, "--timeout", str(start_timeout + signal_timeout + 5))
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True, env=env, start_new_session=True)
    except OSError as exc:
        res.error = f"cannot start `srun`: {exc}"
        return res
    lock = threading.Condition()
    events: list[dict[str, Any]] = []
    err_lines: list[str] = []

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with lock:
                events.append(ev)
                lock.notify_all()
        with lock:
            lock.notify_all()

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line.rstrip())

    readers = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()

    def wait_for(kind: str, count: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with lock:
            while True:
                got = [e for e in events if e.get("event") == kind]
                if len({e.get("node") for e in got}) >= count or (proc.poll() is not None
                                                                   and not readers[0].is_alive()):
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return got
                lock.wait(min(left, 0.2))

    sent_at: float | None = None
    try:
        ready = wait_for("ready", n, start_timeout)
        res.ready = {str(e.get("node")): e for e in ready}
        if len(res.ready) < n:
            res.error = (f"only {len(res.ready)} of {n} probe tasks started within {start_timeout:g} s "
                         f"(ready: {sorted(res.ready) or 'none'})")
            return res
        steps = {e.get("step") for e in ready}
        res.step = str(ready[0].get("step"))
        if len(steps) != 1 or res.step in ("None", ""):
            res.error = f"the probe tasks report no single step id ({sorted(map(str, steps))})"
            return res
        sent_at = time.time()
        try:
            slurm.signal(job_id, sig, step=res.step)
        except Exception as exc:  # a SlurmError, reported as the finding
            res.error = f"`scancel --signal={sig} {job_id}.{res.step}` failed: {exc}"
            return res
        received = wait_for("received", n, signal_timeout)
        res.received = {str(e.get("node")): max(0.0, float(e.get("at", e.get("t", 0))) - sent_at)
                        for e in received}
        return res
    finally:
        try:
            # Every task reported: they are exiting, and srun with them. Otherwise do not wait for the
            # stragglers' own timeout.
            proc.wait(timeout=5 if len(res.received) == n else 0.5)
        except subprocess.TimeoutExpired:
            if res.step:
                try:
                    slurm.signal(job_id, "KILL", step=res.step)
                except Exception:  # the step may be gone already; srun is killed next anyway
                    pass
            proc.kill()
            proc.wait(timeout=10)
        for t in readers:
            t.join(timeout=2)
        res.srun_stderr = "\n".join(err_lines[-20:])


# ---------------------------------------------------------------------------------------------- checks
def check(ctx: DoctorContext) -> list[Finding]:
    """``signals.control-dir`` and ``signals.delivery`` findings."""
    from .context import Finding, Status

    findings = [check_control_dir(ctx)]
    name = "signals.delivery"
    if name in ctx.options.skip:
        findings.append(Finding(name, Status.SKIP, f"skipped (--skip {name})"))
        return findings
    if not ctx.in_allocation:
        findings.append(Finding(name, Status.SKIP, "not inside a Slurm allocation: nothing to signal",
                                "run rslurm doctor inside the job (in the batch script, or salloc)"))
        return findings
    if ctx.slurm is None:
        findings.append(Finding(name, Status.FAIL, "inside an allocation, but scontrol/srun are not on PATH",
                                "load the Slurm module (or fix PATH) in the batch script"))
        return findings
    sig = str(ctx.facts.get("save_signal") or ctx.cfg.save_signal)
    if sig == "none":
        findings.append(Finding(name, Status.SKIP, "save_signal=none: ranks on other nodes hear only the "
                                "control socket of their own node and Slurm's SIGTERM"))
        return findings
    nodes = _job_nodes(ctx)
    if not nodes:
        findings.append(Finding(name, Status.FAIL, f"cannot tell the nodes of job {ctx.job_id} "
                                f"({ctx.job_error or 'no SLURM_JOB_NODELIST'})", "check `scontrol ping`"))
        return findings
    res = probe_signal_delivery(ctx.slurm, str(ctx.job_id), nodes, sig,
                                start_timeout=ctx.options.probe_start_timeout,
                                signal_timeout=ctx.options.signal_timeout, env=dict(ctx.env))
    details: dict[str, Any] = {"signal": sig, "nodes": nodes, "step": res.step,
                               "received_s": {k: round(v, 3) for k, v in res.received.items()},
                               "ready": {k: {"inherited": v.get("inherited"), "blocked": v.get("blocked")}
                                         for k, v in res.ready.items()}}
    if res.error:
        if res.srun_stderr:
            details["srun_stderr"] = res.srun_stderr
        findings.append(Finding(name, Status.FAIL, f"SIG{sig} probe on {len(nodes)} node(s): {res.error}"
                                + (f"; srun said: {res.srun_stderr.splitlines()[-1]}" if res.srun_stderr else ""),
                                "check that srun can start a step in this job (srun --overlap hostname)",
                                details))
        return findings
    ignored = sorted(k for k, v in res.ready.items() if v.get("inherited") == "ignored")
    blocked = sorted(k for k, v in res.ready.items() if v.get("blocked"))
    if res.missing:
        why = f"; blocked in the step's tasks on {', '.join(blocked)}" if blocked else ""
        findings.append(Finding(name, Status.FAIL, f"`scancel --signal={sig} {ctx.job_id}.{res.step}` did not "
                                f"reach {', '.join(res.missing)} within {ctx.options.signal_timeout:g} s{why}; "
                                f"ranks there would not hear the request to save",
                                "ask the admins (proctrack, slurmstepd logs); set RSLURM_SAVE_SIGNAL to "
                                "another signal", details))
        return findings
    if ignored:
        findings.append(Finding(name, Status.FAIL, f"SIG{sig} arrives, but job steps start with it ignored on "
                                f"{', '.join(ignored)}: a rank's Checkpointer leaves an ignored signal alone",
                                f"find what sets SIG{sig} to SIG_IGN (a wrapper, `trap '' {sig}` in the "
                                "script) or choose another RSLURM_SAVE_SIGNAL", details))
        return findings
    worst = max(res.received.values())
    findings.append(Finding(name, Status.OK, f"SIG{sig} through `scancel --signal={sig} {ctx.job_id}.{res.step}` "
                            f"reached the probe on all {len(nodes)} node(s) ({', '.join(nodes)}), slowest after "
                            f"{worst * 1000:.0f} ms", "", details))
    return findings


def _job_nodes(ctx: DoctorContext) -> list[str]:
    job = ctx.job()
    if job is not None and job.nodes:
        return list(job.nodes)
    slurm_env = JobEnv.from_env(ctx.env)
    nodelist = slurm_env.job_nodelist or slurm_env.nodelist
    if nodelist and ctx.slurm is not None:
        try:
            return list(ctx.slurm.hostnames(nodelist))
        except Exception:  # reported as "cannot tell the nodes"
            return []
    return []


def check_control_dir(ctx: DoctorContext) -> Finding:
    """``signals.control-dir``: the launcher's socket directory can be made private (0700) here, and a
    socket path in it fits the Unix limit."""
    from ..control.protocol import default_runtime_dir, default_socket_path
    from ..control.server import ensure_private_dir
    from ..errors import ControlSetupError
    from .context import Finding, Status

    name = "signals.control-dir"
    d = ctx.cfg.control_dir or default_runtime_dir(ctx.env)
    missing = []
    p = os.path.abspath(d)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    try:
        ensure_private_dir(d)
        path = default_socket_path(ctx.job_id or "local-0", ctx.node, runtime_dir=d)
    except ControlSetupError as exc:
        return Finding(name, Status.FAIL, str(exc), "set RSLURM_CONTROL_DIR to a directory of your own "
                       "(mode 0700) whose parents only you or root can modify", {"path": d})
    finally:
        for m in missing:  # leave nothing behind: the launcher makes it again when it starts
            try:
                os.rmdir(m)
            except OSError:
                break
    return Finding(name, Status.OK, f"{d}: private (0700){' (created, then removed)' if missing else ''}; "
                   f"sockets such as {path} fit the Unix limit", "", {"path": d, "socket": path})


if __name__ == "__main__":
    sys.exit(main())
