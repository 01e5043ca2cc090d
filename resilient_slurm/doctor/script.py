"""``rslurm doctor``, group ``script``: the batch script's directives and how it starts the launcher.

Where the directives come from, in sbatch's own order of precedence (later wins):

1. ``#SBATCH`` lines of the script (``--script FILE``; inside an allocation, or with ``--job ID``, the
   job's own script as ``scontrol write batch_script <job> -`` prints it). sbatch reads them from the
   top of the file up to the first line that is neither a comment nor blank, and so does this module.
2. ``SBATCH_*`` input variables of the environment (``SBATCH_SIGNAL``, ``SBATCH_REQUEUE``...).
3. Options given to sbatch on its command line, which doctor cannot see by itself: pass them after
   ``--`` (``rslurm doctor --script job.sh -- --signal=B:USR1@120``).
4. Inside the job, its record: ``Requeue=`` and ``SLURM_OPEN_MODE`` say what Slurm actually applied.
   Slurm 22.05 shows no trace of ``--signal`` in the job record, hence 1-3 for that one.

Call order: :func:`check` (from :func:`resilient_slurm.doctor.run_checks`) reads the script
(:func:`load_script`), parses it (:func:`parse_script`) and returns one finding per concern: signal,
grace, requeue, open-mode, exec, nccl. The pure parts (:func:`parse_script`, :func:`parse_signal`,
:func:`launcher_calls`) are usable on their own.
"""

from __future__ import annotations

import os
import re
import shlex
import signal as _signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError, SlurmError
from ..jobenv import JobEnv
from ..launcher.signals import TRAPPED
from ..paths import read_regular
from .context import DoctorContext, Finding, Status, one_line

# slurmctld looks for jobs due a --signal about every 30 s (docs/testing.md), so the signal comes up to
# that much later than asked.
SIGNAL_JITTER = 30.0
# Below this many seconds left for the save after the jitter and requeue_margin, warn.
MIN_SAVE_WINDOW = 30.0
# Signals the launcher turns into an emergency save when it receives them as the batch shell.
LAUNCHER_SIGNALS = tuple(s.name.removeprefix("SIG") for s in TRAPPED)
DEFAULT_SIGNAL_SECONDS = 60  # sbatch's default when --signal gives no @time

# sbatch options, by long name, that take a value (so "--opt value" consumes the next word).
_TAKES_VALUE = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
distribution error export export-file extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node
gpus-per-socket gpus-per-task gres gres-flags hint input job-name licenses mail-type mail-user mcs-label mem
mem-bind mem-per-cpu mem-per-gpu mincpus network nice nodefile nodelist nodes ntasks ntasks-per-core
ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode output partition power prefer priority profile
propagate qos reservation signal sockets-per-node switches thread-spec threads-per-core time time-min tmp
uid wait-all-nodes wckey exclude extra
""".split())
_SHORT = {"A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint",
          "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile", "G": "gpus",
          "i": "input", "J": "job-name", "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes",
          "n": "ntasks", "o": "output", "p": "partition", "q": "qos", "S": "core-spec", "t": "time",
          "w": "nodelist", "x": "exclude"}
# SBATCH_* input variables that stand for an option (sbatch(1), "INPUT ENVIRONMENT VARIABLES").
_ENV_OPTIONS = {"SBATCH_SIGNAL": "signal", "SBATCH_REQUEUE": "requeue", "SBATCH_NO_REQUEUE": "no-requeue",
                "SBATCH_OPEN_MODE": "open-mode", "SBATCH_GRES": "gres", "SBATCH_GPUS": "gpus",
                "SBATCH_GPUS_PER_NODE": "gpus-per-node", "SBATCH_GPUS_PER_TASK": "gpus-per-task",
                "SBATCH_GPUS_PER_SOCKET": "gpus-per-socket", "SBATCH_PARTITION": "partition",
                "SBATCH_TIMELIMIT": "time"}
_GPU_OPTIONS = ("gpus", "gpus-per-node", "gpus-per-task", "gpus-per-socket")


@dataclass(frozen=True)
class Directive:
    """One sbatch option as given: canonical long name, value, and where it was found."""

    option: str          # "signal", "requeue", "open-mode", ... (long name without dashes)
    value: str | None
    source: str          # "job.sh:3", "$SBATCH_SIGNAL", "sbatch command line"
    text: str            # as written, for messages: "--signal=USR1@60"


@dataclass
class BatchScript:
    """A batch script: its directives (in precedence order) and its command lines."""

    name: str                                     # for messages: a path, or "batch script of job 12"
    directives: list[Directive] = field(default_factory=list)
    body: list[tuple[int, str]] = field(default_factory=list)  # (line number, logical line) after directives

    def last(self, *options: str) -> Directive | None:
        """The directive that wins among ``options`` (the last one given), or None."""
        found = [d for d in self.directives if d.option in options]
        return found[-1] if found else None

    def all(self, *options: str) -> list[Directive]:
        """Every directive among ``options``, in order."""
        return [d for d in self.directives if d.option in options]


@dataclass(frozen=True)
class SignalSpec:
    """A parsed ``--signal=[{R|B}:]<sig>[@<seconds>]``."""

    batch: bool          # B: the batch shell only (not the steps)
    signal: str          # normalized name: "USR1"
    seconds: int         # lead time before the end (default 60)


def parse_signal(text: str) -> SignalSpec:
    """Parse sbatch's ``--signal`` value; ValueError when sbatch would refuse it too."""
    s = text.strip()
    flags, sep, rest = s.partition(":")
    if not sep:
        flags, rest = "", s
    elif not re.fullmatch(r"[RBrb]{1,2}", flags):
        raise ValueError(f"unknown --signal flags {flags!r} (sbatch takes R: and B:)")
    sig, _, when = rest.partition("@")
    name = signal_name(sig)
    if when and not when.strip().isdigit():
        raise ValueError(f"--signal={text}: the time after @ must be a number of seconds")
    return SignalSpec(batch="B" in flags.upper(), signal=name,
                      seconds=int(when) if when else DEFAULT_SIGNAL_SECONDS)


def signal_name(sig: str) -> str:
    """``10``, ``SIGUSR1``, ``usr1`` -> ``USR1`` (ValueError for what is no signal)."""
    s = sig.strip().upper()
    if s.isdigit():
        try:
            return _signal.Signals(int(s)).name.removeprefix("SIG")
        except ValueError:
            raise ValueError(f"{sig!r} is not a signal number on this system") from None
    name = s.removeprefix("SIG")
    if not name or not hasattr(_signal, "SIG" + name):
        raise ValueError(f"{sig!r} is not a signal name")
    return name


def _words(line: str) -> list[str]:
    """Shell words of a line, with operators (``&&``, ``|``, ``;``, ``&``) as their own words and
    comments dropped; plain whitespace splitting when the line does not parse (heredocs, odd quotes)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:
        return line.split("#", 1)[0].split()


def parse_options(words: Sequence[str], source: str) -> list[Directive]:
    """Directives from sbatch option words (``--signal=B:USR1@60``, ``-p low``, ``-N2``)."""
    out: list[Directive] = []
    i = 0
    while i < len(words):
        w = words[i]
        i += 1
        if w.startswith("--"):
            name, eq, value = w[2:].partition("=")
            if not eq and name in _TAKES_VALUE and i < len(words):
                value = words[i]
                i += 1
                text = f"{w} {value}"
            else:
                text = w
            out.append(Directive(name, value if (eq or name in _TAKES_VALUE) else None, source, text))
        elif w.startswith("-") and len(w) >= 2:
            long = _SHORT.get(w[1])
            if long is None:
                continue  # a flag (-H, -O, -Q, -s, -v...) that the checks do not read
            value = w[2:]
            if not value and i < len(words):
                value = words[i]
                i += 1
            out.append(Directive(long, value, source, f"{w[:2]} {value}"))
    return out


def parse_script(text: str, name: str) -> BatchScript:
    """Split a batch script into its ``#SBATCH`` directives and its command lines."""
    script = BatchScript(name)
    lines = text.splitlines()
    i = 0
    if lines and lines[0].startswith("#!"):
        i = 1
    # sbatch stops reading directives at the first line that is neither blank nor a comment.
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if stripped and not stripped.startswith("#"):
            break
        if raw.startswith("#SBATCH"):
            script.directives += parse_options(_words(raw[len("#SBATCH"):]), f"{name}:{i + 1}")
        i += 1
    logical = ""
    start = i + 1
    for n in range(i, len(lines)):
        raw = lines[n]
        if not logical:
            start = n + 1
        if raw.endswith("\\"):
            logical += raw[:-1] + " "
            continue
        logical += raw
        if logical.strip():
            script.body.append((start, logical))
        logical = ""
    if logical.strip():
        script.body.append((start, logical))
    return script


def add_environment(script: BatchScript, env: Mapping[str, str]) -> None:
    """Add the ``SBATCH_*`` input variables (they override the script's directives)."""
    for var, option in _ENV_OPTIONS.items():
        value = env.get(var)
        if value is None:
            continue
        if option in ("requeue", "no-requeue"):
            script.directives.append(Directive(option, None, f"${var}", f"{var}={value}"))
        else:
            script.directives.append(Directive(option, value, f"${var}", f"{var}={value}"))


# ---------------------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class LauncherCall:
    """A line of the script that starts the launcher, and how."""

    line: int
    text: str
    exec_: bool           # `exec` makes the launcher the batch shell
    wrapper: str | None   # a program exec'd in front of the launcher (`timeout`), if any
    background: bool      # ends with `&`
    pipeline: bool        # part of a pipeline (`| tee log`): runs in a subshell
    in_step: bool         # started through srun: the launcher would be a step task, not the batch shell


def _is_launcher(words: Sequence[str], k: int) -> bool:
    w = os.path.basename(words[k])
    if w == "rsrun":
        return True
    if w == "rslurm" and k + 1 < len(words) and words[k + 1] == "launch":
        return True
    # python -m resilient_slurm.cli launch
    return (w == "resilient_slurm.cli" and k >= 1 and words[k - 1] == "-m" and k + 1 < len(words)
            and words[k + 1] == "launch")


def launcher_calls(script: BatchScript) -> list[LauncherCall]:
    """Every command in the script's body that starts ``rslurm launch`` / ``rsrun``."""
    calls = []
    for line_no, line in script.body:
        words = _words(line)
        # Split into simple commands at the shell's list and pipeline operators.
        commands: list[tuple[list[str], str | None, str | None]] = []  # words, operator before, after
        cur: list[str] = []
        before: str | None = None
        for w in words:
            if w and set(w) <= set(";&|"):
                commands.append((cur, before, w))
                cur, before = [], w
            else:
                cur.append(w)
        commands.append((cur, before, None))
        for cmd, op_before, op_after in commands:
            k = next((j for j in range(len(cmd)) if _is_launcher(cmd, j)), None)
            if k is None:
                continue
            head = [w for w in cmd[:k] if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w)]
            is_exec = bool(head) and head[0] == "exec"
            progs = [w for w in head[1:] if not w.startswith("-")] if is_exec else []
            wrapper = None
            if progs and os.path.basename(progs[0]) not in ("env", "python", "python3") \
                    and not os.path.basename(progs[0]).startswith("python"):
                wrapper = progs[0]
            in_step = any(os.path.basename(w) == "srun" for w in head)
            calls.append(LauncherCall(
                line=line_no, text=line.strip(), exec_=is_exec, wrapper=wrapper,
                background=op_after == "&", pipeline="|" in (op_before, op_after), in_step=in_step))
    return calls


def script_save_signal(script: BatchScript) -> tuple[str, str] | None:
    """A save signal the script sets itself (``RSLURM_SAVE_SIGNAL=...`` or ``--save-signal ...`` on the
    launch line) and where, or None."""
    found = None
    for line_no, line in script.body:
        words = _words(line)
        for j, w in enumerate(words):
            m = re.fullmatch(r"RSLURM_SAVE_SIGNAL=(\S+)", w)
            if m:
                found = (m.group(1), f"{script.name}:{line_no}")
            elif w.startswith("--save-signal="):
                found = (w.split("=", 1)[1], f"{script.name}:{line_no}")
            elif w == "--save-signal" and j + 1 < len(words):
                found = (words[j + 1], f"{script.name}:{line_no}")
    return found


# ---------------------------------------------------------------------------------------------- loading
MAX_SCRIPT_BYTES = 4 << 20  # a batch script is a few KiB; one of megabytes is not one


def load_script(ctx: DoctorContext) -> tuple[BatchScript | None, str]:
    """The script to check and where it came from, or None and why there is none."""
    opts = ctx.options
    if opts.script:
        try:  # a regular file only (never a FIFO, /dev/zero), at most MAX_SCRIPT_BYTES, as --config
            text = read_regular(opts.script, MAX_SCRIPT_BYTES, follow=True, what="a batch script", where="--script",
                                error=lambda m: ConfigError(f"--script {m}")).decode("utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(f"--script {opts.script}: cannot read it ({exc.strerror}); give the path of "
                              "the batch script you submit with sbatch") from exc
        return parse_script(text, opts.script), f"file {opts.script}"
    if not ctx.job_id:
        return None, ("no batch script to read: on a login node give --script job.sh (or --job ID for a "
                      "submitted job)")
    if ctx.slurm is None:
        return None, f"job {ctx.job_id}: cannot read its script, the Slurm client tools are not on PATH"
    job = ctx.job()
    if job is not None and job.raw.get("BatchFlag") == "0":
        return None, (f"job {ctx.job_id} is an interactive allocation (salloc/srun): it has no batch script; "
                      "give --script job.sh to check the script you will submit")
    try:
        cp = ctx.slurm.run(["scontrol", "write", "batch_script", str(ctx.job_id), "-"])
    except SlurmError as exc:
        return None, f"cannot read the batch script of job {ctx.job_id}: {one_line(str(exc))}"
    name = f"job {ctx.job_id} script"
    return parse_script(cp.stdout, name), f"the batch script of job {ctx.job_id} (scontrol write batch_script)"


# ---------------------------------------------------------------------------------------------- checks
def check(ctx: DoctorContext) -> list[Finding]:
    """Every ``script.*`` finding (one SKIP row when there is no script to read)."""
    script, source = load_script(ctx)
    if script is None:
        return [Finding("script", Status.SKIP, source,
                        "rslurm doctor --script job.sh (login node) or run it inside the job")]
    add_environment(script, ctx.env)
    if ctx.options.sbatch_args:
        script.directives += parse_options(list(ctx.options.sbatch_args), "sbatch command line")
    ctx.facts["script_source"] = source
    part = script.last("partition")
    if part is not None and part.value:
        ctx.facts["partition"] = part.value.split(",")[0]
    spec = _signal_spec(script)
    findings = [
        _check_signal(ctx, script, spec),
        _check_grace(ctx, spec),
        _check_requeue(ctx, script),
        _check_open_mode(ctx, script),
        _check_exec(script, spec),
        _check_nccl(ctx, script, spec),
    ]
    for f in findings:
        f.details.setdefault("source", source)
    return findings


def _signal_spec(script: BatchScript) -> tuple[SignalSpec | None, Directive | None, str | None]:
    d = script.last("signal")
    if d is None or d.value is None:
        return None, d, None
    try:
        return parse_signal(d.value), d, None
    except ValueError as exc:
        return None, d, str(exc)


def _check_signal(ctx: DoctorContext, script: BatchScript,
                  parsed: tuple[SignalSpec | None, Directive | None, str | None]) -> Finding:
    spec, d, error = parsed
    name = "script.signal"
    good = "#SBATCH --signal=B:USR1@120"
    if d is None:
        job = ctx.job() if ctx.job_id else None
        unlimited = job is not None and job.time_limit is None
        where = " (one given on the sbatch command line does not show in Slurm 22.05's job record: pass it " \
                "after --, as in `rslurm doctor -- --signal=B:USR1@120`)" if ctx.job_id else ""
        if unlimited:
            return Finding(name, Status.WARN, f"no --signal in {script.name}{where}; the job has no time "
                           "limit, so only preemption (SIGTERM to the ranks) can stop it", good)
        conf = ctx.slurm_config()
        kill_wait = f"KillWait={conf['KillWait']}" if conf and conf.get("KillWait") else "KillWait (30 s by default)"
        return Finding(name, Status.FAIL, f"no --signal in {script.name}{where}: at the time limit Slurm sends "
                       f"SIGTERM only {kill_wait} before SIGKILL, and the job is not requeued",
                       f"add `{good}`, and start the launcher with exec")
    if error is not None or spec is None:
        return Finding(name, Status.FAIL, f"`{d.text}` ({d.source}): {error}", f"use `{good}`")
    details = {"directive": d.text, "at": d.source, "batch": spec.batch, "signal": spec.signal,
               "seconds": spec.seconds}
    if not spec.batch:
        return Finding(name, Status.FAIL,
                       f"`{d.text}` ({d.source}) has no B: flag: Slurm signals the job's steps (every rank) "
                       "instead of the batch shell, so the launcher never hears it and nobody requeues the job",
                       f"use `--signal=B:{spec.signal}@{spec.seconds}`", details)
    if spec.signal not in LAUNCHER_SIGNALS:
        return Finding(name, Status.FAIL,
                       f"`{d.text}` ({d.source}): the launcher does not trap SIG{spec.signal} (it traps "
                       f"{', '.join(LAUNCHER_SIGNALS)}), so the signal kills it",
                       f"use `--signal=B:USR1@{spec.seconds}`", details)
    return Finding(name, Status.OK, f"`{d.text}` ({d.source}): SIG{spec.signal} to the batch shell "
                   f"{spec.seconds} s before the end", "", details)


def _check_grace(ctx: DoctorContext,
                 parsed: tuple[SignalSpec | None, Directive | None, str | None]) -> Finding:
    spec, d, _ = parsed
    name = "script.grace"
    if spec is None or d is None:
        return Finding(name, Status.SKIP, "no usable --signal, so no lead time to check")
    margin = float(ctx.cfg.requeue_margin)
    window = spec.seconds - SIGNAL_JITTER - margin
    ctx.facts["save_window"] = window
    ctx.facts["signal_seconds"] = spec.seconds
    details = {"seconds": spec.seconds, "jitter": SIGNAL_JITTER, "requeue_margin": margin,
               "save_window": window}
    what = (f"@{spec.seconds}: Slurm sends the signal up to {SIGNAL_JITTER:.0f} s late and the launcher keeps "
            f"requeue_margin={margin:g} s, which leaves {window:.0f} s to save")
    suggest = f"raise it, e.g. `--signal=B:{spec.signal}@{max(120, int(spec.seconds * 2))}`"
    if window <= 0:
        return Finding(name, Status.FAIL, what, suggest, details)
    if window < MIN_SAVE_WINDOW:
        return Finding(name, Status.WARN, what, suggest, details)
    return Finding(name, Status.OK, what, "", details)


def _check_requeue(ctx: DoctorContext, script: BatchScript) -> Finding:
    name = "script.requeue"
    d = script.last("requeue", "no-requeue")
    fix = "add `#SBATCH --requeue`"
    job = ctx.job() if ctx.job_id else None
    if job is not None:
        src = f"job {job.job_id} record"
        if not job.requeue:
            why = f" (`{d.text}`, {d.source})" if d is not None and d.option == "no-requeue" else ""
            return Finding(name, Status.FAIL, f"{src}: Requeue=0{why}: the launcher cannot requeue this job",
                           fix, {"requeue": False})
        how = f"from `{d.text}`, {d.source}" if d is not None and d.option == "requeue" else "the site default"
        return Finding(name, Status.OK, f"{src}: Requeue=1 ({how})", "", {"requeue": True})
    if d is not None and d.option == "no-requeue":
        return Finding(name, Status.FAIL, f"`{d.text}` ({d.source}): the launcher cannot requeue this job", fix)
    if d is not None:
        return Finding(name, Status.OK, f"`{d.text}` ({d.source})", "", {"requeue": True})
    conf = ctx.slurm_config()
    site = conf.get("JobRequeue") if conf else None
    if site == "0":
        return Finding(name, Status.FAIL, f"no --requeue in {script.name}, and the cluster's JobRequeue=0 makes "
                       "batch jobs non-requeueable", fix)
    if site == "1":
        return Finding(name, Status.WARN, f"no --requeue in {script.name}: relies on the cluster default "
                       "JobRequeue=1", fix)
    return Finding(name, Status.WARN, f"no --requeue in {script.name}, and the cluster's JobRequeue default "
                   "is unknown here", fix)


def _check_open_mode(ctx: DoctorContext, script: BatchScript) -> Finding:
    name = "script.open-mode"
    fix = "add `#SBATCH --open-mode=append`"
    mode = JobEnv.from_env(ctx.env).open_mode
    if ctx.in_allocation and mode in ("a", "t"):
        if mode == "a":
            return Finding(name, Status.OK, "the job appends to its output (SLURM_OPEN_MODE=a)")
        return Finding(name, Status.WARN, "the job truncates its output (SLURM_OPEN_MODE=t): each requeue "
                       "erases the log of the incarnations before it", fix)
    d = script.last("open-mode")
    if d is not None and d.value is not None:
        if d.value.lower().startswith("a"):
            return Finding(name, Status.OK, f"`{d.text}` ({d.source})")
        return Finding(name, Status.WARN, f"`{d.text}` ({d.source}): each requeue erases the log of the "
                       "incarnations before it", fix)
    conf = ctx.slurm_config()
    if conf and conf.get("JobFileAppend") == "1":
        return Finding(name, Status.OK, "no --open-mode; the cluster's JobFileAppend=1 appends")
    return Finding(name, Status.WARN, f"no --open-mode=append in {script.name}: a requeued job truncates its "
                   "output file, losing the log of the incarnations before it", fix)


def _check_exec(script: BatchScript,
                parsed: tuple[SignalSpec | None, Directive | None, str | None]) -> Finding:
    name = "script.exec"
    calls = launcher_calls(script)
    fix = "start it as `exec rsrun python train.py` (= `exec rslurm launch -- srun python train.py`)"
    if not calls:
        return Finding(name, Status.WARN, f"no `rsrun` or `rslurm launch` command in {script.name}: the job "
                       "does not run under the launcher (no emergency save on a signal, no requeue)", fix)
    spec = parsed[0]
    sig = f"SIG{spec.signal}" if spec is not None else "the --signal=B: signal"
    for c in calls:
        where = f"{script.name}:{c.line}"
        details = {"line": c.line, "command": c.text}
        if c.in_step:
            return Finding(name, Status.FAIL, f"{where}: the launcher runs inside srun, as a step task; it must "
                           "be the batch shell, and it starts srun itself", fix, details)
        if c.pipeline:
            return Finding(name, Status.FAIL, f"{where}: the launcher is part of a pipeline, so it runs in a "
                           f"subshell and {sig} goes to bash, which does not forward it",
                           "drop the pipe (the job's output file already has the launcher's output); " + fix,
                           details)
        if c.background:
            return Finding(name, Status.FAIL, f"{where}: the launcher runs in the background (&): {sig} goes to "
                           "bash, which does not forward it", fix, details)
        if not c.exec_:
            return Finding(name, Status.FAIL, f"{where}: `{c.text}` without exec: {sig} goes to the batch "
                           "shell (bash), which does not forward it, so the launcher never hears it", fix, details)
        if c.wrapper:
            return Finding(name, Status.WARN, f"{where}: `exec {c.wrapper} ...`: {c.wrapper} is the batch shell "
                           f"and must pass {sig} on to the launcher", fix, details)
    return Finding(name, Status.OK, f"{script.name}:{calls[0].line}: `{calls[0].text}`",
                   "", {"line": calls[0].line, "command": calls[0].text})


def _nccl_evidence(ctx: DoctorContext, script: BatchScript) -> list[str]:
    out = []
    for d in script.all("gres"):
        if d.value and re.search(r"(^|,)(gres/)?gpu\b", d.value):
            out.append(f"`{d.text}` ({d.source})")
    for d in script.all(*_GPU_OPTIONS):
        if d.value and d.value.strip() not in ("0", ""):
            out.append(f"`{d.text}` ({d.source})")
    job = ctx.job() if ctx.job_id else None
    if job is not None:
        tres = " ".join(job.raw.get(k, "") for k in ("TRES", "TresPerNode", "TresPerJob", "TresPerTask"))
        if "gpu" in tres:
            out.append(f"job {job.job_id} record ({tres.strip()})")
    if ctx.in_allocation:
        cvd = ctx.env.get("CUDA_VISIBLE_DEVICES", "")
        if cvd and cvd not in ("NoDevFiles", "-1"):
            out.append(f"CUDA_VISIBLE_DEVICES={cvd}")
    nccl_vars = sorted(k for k in ctx.env if k.startswith("NCCL_"))
    if nccl_vars:
        out.append("NCCL variables set (" + ", ".join(nccl_vars[:3]) + (", ..." if len(nccl_vars) > 3 else "") + ")")
    return out


def _check_nccl(ctx: DoctorContext, script: BatchScript,
                parsed: tuple[SignalSpec | None, Directive | None, str | None]) -> Finding:
    name = "script.nccl"
    spec, d, _ = parsed
    override = ctx.options.nccl
    evidence = _nccl_evidence(ctx, script)
    uses = override if override is not None else bool(evidence)
    why = ("--nccl" if override else "--no-nccl") if override is not None else (
        "; ".join(evidence) if evidence else "no GPUs requested")
    save_signal, save_source = str(ctx.cfg.save_signal), "save_signal setting"
    in_script = script_save_signal(script)
    if in_script is not None:
        value, where = in_script
        if value.lower() in ("none", "off"):
            save_signal, save_source = "none", where
        else:
            try:
                save_signal, save_source = signal_name(value), where
            except ValueError:  # `$SIG` or another expansion: the setting is what doctor can know
                pass
    ctx.facts["save_signal"] = save_signal
    details = {"nccl": uses, "evidence": evidence, "save_signal": save_signal, "save_signal_from": save_source}
    problems = []
    if spec is not None and d is not None and not spec.batch and spec.signal == "USR1":
        problems.append(f"`{d.text}` ({d.source}) sends SIGUSR1 to every rank")
    if save_signal == "USR1":
        problems.append(f"save_signal=USR1 ({save_source}) is sent to every rank")
    dump = ctx.env.get("NCCL_PROXY_DUMP_SIGNAL", "")
    if dump.strip().lstrip("-").isdigit() and save_signal not in ("none", "") and int(dump) > 0:
        try:
            if _signal.Signals(int(dump)).name.removeprefix("SIG") == save_signal:
                problems.append(f"NCCL_PROXY_DUMP_SIGNAL={dump} makes NCCL catch SIG{save_signal}, the save signal")
        except ValueError:
            pass
    nccl_note = ("NCCL takes SIGUSR1 in the ranks (NCCL 2.12 always catches it; later versions with "
                 "NCCL_PROXY_DUMP_SIGNAL), so the request to save is swallowed")
    fix = "keep --signal=B:USR1 (it reaches only the launcher) and the save signal USR2 (RSLURM_SAVE_SIGNAL)"
    if uses and problems:
        return Finding(name, Status.FAIL, f"the job uses NCCL ({why}): " + "; ".join(problems) + f": {nccl_note}",
                       fix, details)
    if problems:
        return Finding(name, Status.WARN, f"no sign of NCCL ({why}), but " + "; ".join(problems) + ": that "
                       "clashes with NCCL as soon as the job uses GPUs", fix + "; --nccl checks as if it did",
                       details)
    if uses:
        return Finding(name, Status.OK, f"the job uses NCCL ({why}); the ranks' save signal is "
                       f"{save_signal if save_signal == 'none' else 'SIG' + save_signal}, not SIGUSR1", "", details)
    return Finding(name, Status.OK, f"no sign of NCCL ({why}); nothing sends SIGUSR1 to the ranks", "", details)
