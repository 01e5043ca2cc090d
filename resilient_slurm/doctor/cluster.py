"""``rslurm doctor``, group ``cluster``: the site's preemption and kill settings, as Slurm reports them.

Reads ``scontrol show config`` (PreemptType, PreemptMode, SlurmctldParameters, SchedulerParameters,
KillWait, SLURM_VERSION) and the partition the job runs in (``scontrol show partition``): the job's own
inside an allocation or with ``--job``, else ``--partition``/``-p`` of the script, else the cluster's
default partition. Called by :func:`resilient_slurm.doctor.run_checks` after the ``script`` group, whose
facts (the --signal lead time) it compares with GraceTime. Read only.
"""

from __future__ import annotations

from ..errors import SlurmError
from ..slurm import PartitionInfo, parse_duration, parse_scontrol_record
from ..slurm.cli_backend import partition_info_from_record
from .context import DoctorContext, Finding, Status, one_line

USER_SIGNAL_KEY = "preempt_send_user_signal"
MIN_KILL_WAIT = 10.0


def _partition(ctx: DoctorContext) -> tuple[PartitionInfo | None, str]:
    """The partition to check and how it was chosen (or None and why)."""
    assert ctx.slurm is not None
    job = ctx.job() if ctx.job_id else None
    name, how = None, ""
    if job is not None and job.partition:
        name, how = job.partition.split(",")[0], f"job {job.job_id}'s partition"
    elif ctx.facts.get("partition"):
        name, how = ctx.facts["partition"], "the script's --partition"
    try:
        cp = ctx.slurm.run(["scontrol", "show", "partition", "-o", *([name] if name else [])], query=True)
    except SlurmError as exc:
        return None, f"cannot read partition {name or '(default)'}: {one_line(str(exc))}"
    records = [parse_scontrol_record(line, known_keys=(), free_text_keys=())
               for line in cp.stdout.splitlines() if line.strip()]
    for rec in records:
        if (name and rec.get("PartitionName") == name) or (not name and rec.get("Default") == "YES"):
            return partition_info_from_record(rec), how or "the default partition"
    return None, f"no partition {name!r}" if name else "the cluster has no default partition (give --partition)"


def check(ctx: DoctorContext) -> list[Finding]:
    """Every ``cluster.*`` finding (one row when Slurm cannot be asked)."""
    conf = ctx.slurm_config()
    if conf is None:
        if ctx.slurm is None:
            return [Finding("cluster", Status.SKIP, "the Slurm client tools (scontrol) are not on PATH: no "
                            "cluster settings to read", "run rslurm doctor on a login or compute node")]
        status = Status.FAIL if ctx.in_allocation else Status.WARN
        return [Finding("cluster", status, f"cannot read the Slurm configuration: {ctx.config_error}",
                        "check `scontrol ping` and SLURM_CONF; inside a job the launcher needs scontrol to "
                        "requeue")]
    part, how = _partition(ctx)
    findings = [_preemption(ctx, conf, part, how), _user_signal(ctx, conf), _kill_wait(conf)]
    version = conf.get("SLURM_VERSION")
    for f in findings:
        if version:
            f.details.setdefault("slurm_version", version)
    return findings


def _preemption(ctx: DoctorContext, conf: dict[str, str], part: PartitionInfo | None, how: str) -> Finding:
    name = "cluster.preemption"
    ptype = conf.get("PreemptType", "preempt/none")
    details: dict[str, object] = {"preempt_type": ptype}
    if ptype in ("preempt/none", "(null)", ""):
        ctx.facts["preemption"] = False
        return Finding(name, Status.OK, f"PreemptType={ptype}: jobs are never preempted", "", details)
    if part is None:
        return Finding(name, Status.WARN, f"PreemptType={ptype}, but {how}", "give --partition", details)
    mode = part.preempt_mode.upper()
    grace = part.grace_time
    details.update(partition=part.name, preempt_mode=mode, grace_time=grace, chosen_by=how)
    ctx.facts["preemption"] = "OFF" not in mode
    ctx.facts["grace_time"] = grace
    where = f"partition {part.name} ({how}): PreemptMode={mode}, GraceTime={grace:g} s"
    if "OFF" in mode:
        return Finding(name, Status.OK, f"{where}: its jobs are not preempted", "", details)
    if "SUSPEND" in mode:
        return Finding(name, Status.WARN, f"{where}: preempted jobs are suspended, not stopped; they keep "
                       "their memory (GPU memory included) and nothing asks them to save", "", details)
    margin = float(ctx.cfg.requeue_margin)
    if grace <= 0:
        kill_wait = parse_duration(conf.get("KillWait", "30")) or 0.0
        return Finding(name, Status.WARN, f"{where}: no GraceTime, so a preempted job gets only KillWait="
                       f"{kill_wait:g} s between SIGTERM and SIGKILL to save",
                       "ask the admins for a GraceTime that fits an emergency save (e.g. 120 s)", details)
    if grace - margin < 30:
        return Finding(name, Status.WARN, f"{where}: after requeue_margin={margin:g} s that leaves "
                       f"{grace - margin:.0f} s for the emergency save at preemption",
                       "ask the admins for a longer GraceTime, or keep checkpoints small", details)
    if "CANCEL" in mode:
        return Finding(name, Status.WARN, f"{where}: preempted jobs are cancelled; only the launcher's own "
                       "requeue, after the emergency save within GraceTime, brings the job back",
                       "use a partition (or QOS) with PreemptMode=REQUEUE if there is one", details)
    seconds = ctx.facts.get("signal_seconds")
    note = ""
    if isinstance(seconds, (int, float)) and grace < seconds:
        note = f"; less than the {seconds:g} s your --signal plans for the time limit"
    return Finding(name, Status.OK, f"{where}: preempted jobs are requeued and get {grace:g} s to save{note}",
                   "", details)


def _user_signal(ctx: DoctorContext, conf: dict[str, str]) -> Finding:
    name = "cluster.user-signal"
    ctld = conf.get("SlurmctldParameters", "")
    sched = conf.get("SchedulerParameters", "")
    in_ctld = USER_SIGNAL_KEY in ctld.split(",")
    in_sched = USER_SIGNAL_KEY in sched.split(",")
    details = {"SlurmctldParameters": ctld, "SchedulerParameters": sched}
    if ctx.facts.get("preemption") is False:
        return Finding(name, Status.SKIP, "no preemption here, so it does not matter which signal it sends",
                       "", details)
    if in_ctld:
        return Finding(name, Status.OK, f"SlurmctldParameters has {USER_SIGNAL_KEY}: at preemption the "
                       "job's --signal (B:USR1) reaches the launcher when GraceTime starts", "", details)
    version = conf.get("SLURM_VERSION", "")
    if in_sched:
        return Finding(name, Status.WARN, f"{USER_SIGNAL_KEY} is in SchedulerParameters, where Slurm 22.05 "
                       f"(this is {version or 'unknown'}) ignores it: at preemption the ranks get SIGTERM and "
                       "the launcher hears nothing until GraceTime ends",
                       f"ask the admins to move it to SlurmctldParameters={USER_SIGNAL_KEY}", details)
    return Finding(name, Status.WARN, f"no {USER_SIGNAL_KEY} in SlurmctldParameters: at preemption Slurm sends "
                   "SIGTERM to the ranks (they still save) and the launcher hears nothing until GraceTime ends, "
                   "so it learns of the preemption late",
                   f"ask the admins for SlurmctldParameters={USER_SIGNAL_KEY}", details)


def _kill_wait(conf: dict[str, str]) -> Finding:
    name = "cluster.kill-wait"
    raw = conf.get("KillWait", "")
    try:
        kill_wait = parse_duration(raw) if raw else None
    except ValueError:
        kill_wait = None
    if kill_wait is None:
        return Finding(name, Status.WARN, f"KillWait={raw or '?'} could not be read", "", {"kill_wait": raw})
    details = {"kill_wait": kill_wait, "job_requeue": conf.get("JobRequeue")}
    what = (f"KillWait={kill_wait:g} s between SIGTERM and SIGKILL: what a scancel, the end of GraceTime, or "
            "a time limit without --signal leave to save")
    if kill_wait < MIN_KILL_WAIT:
        return Finding(name, Status.WARN, what, "rely on --signal=B:USR1@<s> and GraceTime, not on KillWait",
                       details)
    return Finding(name, Status.OK, what, "", details)
