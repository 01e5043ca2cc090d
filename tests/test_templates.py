"""The sbatch templates and ``rslurm submit``.

Rendering (no cluster): every shipped template renders with the options given replacing its
``#SBATCH`` lines, the command shell-quoted, and runs under real bash up to the launcher (a recording
``rslurm`` on PATH), by hand with the command as arguments too. Bad input is a clear error (exit 2).

On the real two-node Slurm test cluster (tests/slurm_cluster.py), each template is submitted by
``rslurm submit`` itself with a small real training run (``resilient_slurm.examples.train_toy``):

* single node, 2 ranks: a time-limit-style USR1 to the batch shell (``scancel --batch --signal=USR1``)
  mid-run; the job saves, requeues, resumes from that step and completes;
* multi node, one rank per node: completes with the final step committed on both nodes;
* job array of 2 tasks: each completes with its own run id (``<array job>_<task>``);
* torchrun, one torchrun per node (2 nodes x 1 worker): first the USR1 (the launcher asks over the
  control socket only; the worker on n2 is cut off from the socket, as on a real cluster, and must
  save the same step through the ranks' collective), then a SIGTERM from Slurm to the step's processes,
  as at preemption on clusters without ``preempt_send_user_signal``. Both times every rank resumes from
  the emergency step on its own node.

A failing sbatch (unknown partition) exits 1 with sbatch's message.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, read_jsonl, wait_for_step
from slurm_cluster import SlurmCluster

from resilient_slurm import submit
from resilient_slurm.cli import main as rslurm_main

TEMPLATES = ("single_node", "multi_node", "multi_node_torchrun", "job_array")
PY = sys.executable
TOY = ["python", "-m", "resilient_slurm.examples.train_toy"]
# An argument list a naive renderer would break: quotes, $, ;, a glob, an empty and a multi-line argument.
NASTY = ["python", "train.py", "--name", "it's $HOME; rm -rf / *", "--empty", "", "--text", "two\nlines"]


def _rslurm(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = rslurm_main(["submit", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _directives(script: str) -> list[submit.Directive]:
    """The #SBATCH options sbatch would read: header lines up to the first command."""
    found: list[submit.Directive] = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            found += submit.parse_sbatch_options(submit.split_directive(line[7:])[0], where="test")
    return found


def _fake_tools(tmp_path: Path) -> Path:
    """``rslurm``, ``scontrol`` and ``torchrun`` stand-ins on PATH that record how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in {
        "rslurm": 'printf "%s\\0" "$@" > "$RECORD/rslurm.argv"; env -0 > "$RECORD/rslurm.env"',
        "scontrol": '[ "$1 $2" = "show hostnames" ] && printf "gpu01\\ngpu02\\n"',
        "torchrun": 'printf "%s\\0" "$@" > "$RECORD/torchrun.argv"; '
                    'if [ -n "${TERM_PARENT:-}" ]; then kill -TERM $PPID; sleep 0.2; fi; exit "${EXIT_CODE:-0}"',
    }.items():
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def _run_script(path: Path, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                                                list[str], dict[str, str]]:
    """Run a batch script with bash as Slurm would (job variables set), up to the recording rslurm."""
    record = tmp_path / "record"
    record.mkdir(exist_ok=True)
    for f in record.iterdir():
        f.unlink()
    base = {"PATH": f"{_fake_tools(tmp_path)}:/usr/bin:/bin", "RECORD": str(record), "USER": "alice",
            "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_CPUS_PER_TASK": "4", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    cp = subprocess.run(["bash", str(path), *args], env={**base, **env}, capture_output=True, text=True,
                        timeout=30)
    argv = (record / "rslurm.argv").read_bytes().decode().split("\0")[:-1] if (record / "rslurm.argv").exists() else []
    job_env: dict[str, str] = {}
    if (record / "rslurm.env").exists():
        for item in (record / "rslurm.env").read_bytes().decode().split("\0"):
            k, _, v = item.partition("=")
            job_env[k] = v
    return cp, argv, job_env


# --------------------------------------------------------------------------------------------- rendering
@pytest.mark.proc
@pytest.mark.parametrize("name", TEMPLATES)
def test_template_renders_with_options_replaced_and_the_command_quoted(name: str, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    rc, script, err = _rslurm(capsys, "--template", name, "-N", "3", "--time=02:00:00", "-p", "gpu",
                              "--gres=gpu:4", "-J", "sweep #2", "--grace", "300", "--local-dir", "/nvme/a b/%n",
                              "--durable", "s3://bkt/ckpt", "--mail-type=END", "--dry-run", "--", *NASTY)
    assert rc == 0, err
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    d = _directives(script)
    names = [x.name for x in d]
    # Given options replace the template's line (once each), new ones are added; sbatch reads them all.
    assert len(names) == len(set(names)), names
    got = {x.name: x.value for x in d}
    assert got["nodes"] == "3" and got["time"] == "02:00:00" and got["job-name"] == "sweep #2", got
    assert got["partition"] == "gpu" and got["gres"] == "gpu:4" and got["mail-type"] == "END", got
    assert got["signal"] == "B:USR1@300" and got["open-mode"] == "append" and "requeue" in got, got
    # The template's own choices that were not overridden survive.
    template = (REPO / "sbatch_templates" / f"{name}.sbatch").read_text()
    for x in _directives(template):
        if x.name not in ("nodes", "time", "job-name", "signal"):
            assert got[x.name] == x.value, (x, got)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # Run it as Slurm would: the launcher gets exactly the command, argument for argument.
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    cp, argv, env = _run_script(path, tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert argv[:3] == ["launch", "--", "srun"], argv
    assert argv[-len(NASTY):] == NASTY, argv
    assert env["RSLURM_LOCAL_DIR"] == "/nvme/a b/%n" and env["RSLURM_DURABLE"] == "s3://bkt/ckpt", env
    assert env["SRUN_CPUS_PER_TASK"] == "4"
    if name == "job_array":
        assert env["RSLURM_RUN_ID"] == "40_3"
    if name == "multi_node_torchrun":
        assert env["RSLURM_SAVE_SIGNAL"] == "none"
        # The rendezvous is the launcher's, per task (the step's first node's NodeAddr): the script sets none.
        assert not {"MASTER_ADDR", "MASTER_PORT", "RDZV_HOST", "RDZV_PORT"} & set(env), env


@pytest.mark.proc
@pytest.mark.parametrize("name", TEMPLATES)
def test_template_runs_by_hand_with_the_command_as_arguments(name: str, tmp_path: Path):
    """`sbatch TEMPLATE cmd args...` needs no rendering: the defaults apply, submit-time variables win."""
    path = REPO / "sbatch_templates" / f"{name}.sbatch"
    cp, argv, env = _run_script(path, tmp_path, *NASTY)
    assert cp.returncode == 0, cp.stderr
    assert argv[-len(NASTY):] == NASTY
    assert env["RSLURM_LOCAL_DIR"] == "/local/nvme/alice/%n" and env["RSLURM_DURABLE"] == ""
    assert env.get("RSLURM_RUN_ID") == ("40_3" if name == "job_array" else None)
    cp, _, env = _run_script(path, tmp_path, "python", "t.py", RSLURM_LOCAL_DIR="/scratch/%n",
                             RSLURM_DURABLE="/lustre/ck", RSLURM_RUN_ID="sweep1")
    assert env["RSLURM_LOCAL_DIR"] == "/scratch/%n" and env["RSLURM_DURABLE"] == "/lustre/ck"
    assert env["RSLURM_RUN_ID"] == ("sweep1_3" if name == "job_array" else "sweep1")
    cp, argv, _ = _run_script(path, tmp_path)
    assert cp.returncode == 2 and "no training command" in cp.stderr and argv == []


@pytest.mark.proc
def test_torchrun_line_uses_stable_node_ranks_and_turns_a_slurm_sigterm_into_a_signal_exit(tmp_path: Path):
    """The per-node command of the torchrun template, run by real bash: torchrun gets the node's rank
    from SLURM_NODEID and the command after `--`; when the task is SIGTERMed (Slurm stopping the step)
    and torchrun then exits 1, the task ends by SIGTERM (restartable), not with torchrun's 1."""
    path = REPO / "sbatch_templates" / "multi_node_torchrun.sbatch"
    cp, argv, env = _run_script(path, tmp_path, *NASTY, SLURM_GPUS_ON_NODE="4")
    assert cp.returncode == 0, cp.stderr
    i = argv.index("-c")
    assert argv[:i] == ["launch", "--", "srun", "--ntasks-per-node=1", "bash"], argv
    inner, rest = argv[i + 1], argv[i + 2:]
    assert rest == ["torchrun", *NASTY]
    # What the launcher's task prolog gives each task: the step's first node's NodeAddr and the job's port.
    task_env = {"PATH": env["PATH"], "RECORD": env["RECORD"], "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1",
                "NPROC_PER_NODE": env["NPROC_PER_NODE"], "MASTER_ADDR": "10.0.3.7", "MASTER_PORT": str(15000 + 42)}
    record = Path(env["RECORD"])

    def task(**extra: str) -> int:
        return subprocess.run(["bash", "-c", inner, *rest], env={**task_env, **extra}, timeout=30).returncode

    assert task() == 0
    torchrun_argv = (record / "torchrun.argv").read_bytes().decode().split("\0")[:-1]
    assert torchrun_argv == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=10.0.3.7",
                             f"--master-port={15000 + 42}", "--max-restarts=0", "--no-python", "--", *NASTY]
    assert task(EXIT_CODE="3") == 3  # a worker's error stays an error
    assert task(TERM_PARENT="1", EXIT_CODE="1") == -signal.SIGTERM


def test_a_template_file_without_markers_gets_settings_and_multi_option_lines_rewritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    own = tmp_path / "mine.sh"
    own.write_text('#!/bin/bash\n#SBATCH -N 1 --ntasks=2 --requeue   # sizes\n#SBATCH --time=60\n'
                   'echo start\nset -- "$@"\nexec rslurm launch -- srun "$@"\n')
    rc, script, err = _rslurm(capsys, "--template", str(own), "--nodes=4", "--no-requeue", "--grace=90",
                              "--local-dir", "/tmp/l/%n", "--dry-run", "--", "python", "x.py")
    assert rc == 0, err
    assert re.search(r"^#SBATCH --nodes=4 --ntasks=2 +# sizes$", script, re.M), script  # --requeue dropped
    got = {x.name: x.value for x in _directives(script)}
    assert got == {"nodes": "4", "ntasks": "2", "time": "60", "no-requeue": None, "signal": "B:USR1@90"}, got
    lines = script.splitlines()
    assert lines.index("export RSLURM_LOCAL_DIR=/tmp/l/%n  # given to rslurm submit") == \
        lines.index("set -- python x.py") - 1
    assert lines.index("echo start") > max(i for i, x in enumerate(lines) if x.startswith("#SBATCH"))


def test_list_and_help(capsys: pytest.CaptureFixture[str]):
    rc, out, _ = _rslurm(capsys, "--list")
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == sorted(TEMPLATES)
    rc, out, _ = _rslurm(capsys, "--help")
    assert rc == 0 and "--template NAME|FILE" in out and "Exit codes" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--template", "nope", "--", "python"], "unknown template 'nope'; shipped templates: job_array, multi_node"),
    (["--template", "./nope.sbatch", "--", "python"], "template file ./nope.sbatch does not exist"),
    (["--template", "/dev/zero", "--", "python"], "template file /dev/zero is a character device, not a regular file"),
    (["--template", "/tmp", "--", "python"], "template file /tmp is a directory, not a regular file"),
    (["--template", "single_node", "python", "t.py"], "unexpected argument 'python'"),
    (["--template", "single_node"], "no command: put the training command after `--`"),
    (["--template", "single_node", "--"], "the command after `--` is empty"),
    (["--", "python"], "--template is required"),
    (["--template", "single_node", "--grace", "0", "--", "python"], "--grace must be a positive whole number"),
    (["--template", "single_node", "--grace", "-5", "--", "python"], "got '-5'"),
    (["--template", "single_node", "--grace=1.5", "--", "python"], "got '1.5'"),
    (["--template", "single_node", "--grace", "abc", "--", "python"], "got 'abc'"),
    (["--template", "single_node", "--grace", "60", "--signal=B:USR2@60", "--", "python"], "not both"),
    (["--template", "single_node", "-t", "1", "--", "python"], "only 60 s"),
    (["--template", "single_node", "--wrap=hostname", "--", "python"], "--wrap is not supported"),
    (["--template", "single_node", "-Z", "--", "python"], "unknown option '-Z'"),
    (["--template", "single_node", "-N", "--", "python"], "-N (--nodes) needs a value"),
    (["--template", "single_node", "-N", "2", "4", "--", "python"], "unexpected argument '4'"),
    (["--template", "single_node", "--time"], "--time needs a value"),
    (["--template", "single_node", "--requeue=yes", "--", "python"], "--requeue takes no value"),
    (["--template", "single_node", "--ntasks-per", "4", "--", "python"], "--ntasks-per is ambiguous"),
])
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]):
    rc, out, err = _rslurm(capsys, "--dry-run", *argv)
    assert rc == 2 and out == "", (rc, out)
    assert err.startswith("rslurm: error: rslurm submit: ") and message in err, err


def test_a_template_without_the_command_line_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#!/bin/bash\n#SBATCH --nodes=1\nsrun python train.py\n")
    rc, _, err = _rslurm(capsys, "--template", str(bad), "--dry-run", "--", "python")
    assert rc == 2 and 'must have exactly one line `set -- "$@"`' in err and str(bad) in err, err
    bad.write_text("#SBATCH --nodes=1\nset -- \"$@\"\n")
    rc, _, err = _rslurm(capsys, "--template", str(bad), "--dry-run", "--", "python")
    assert rc == 2 and "does not start with a `#!` line" in err, err


# --------------------------------------------------------------------------------------------- the cluster
def _job_env(slurm: SlurmCluster, work: Path, **extra: str) -> dict[str, str]:
    """What a user's shell would hold when submitting: this cluster, rslurm and python on PATH."""
    env = slurm.env({
        "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1", "RSLURM_LOG_LEVEL": "INFO",
        # Nothing rendezvous-related: the emulated nodes n1 and n2 are names only Slurm knows, and the
        # templates (through the launcher) derive MASTER_ADDR and MASTER_PORT. Test clusters that run at
        # the same time may number jobs alike: their control sockets are kept apart.
        "RSLURM_CONTROL_DIR": str(slurm.root / "ctl"), **extra})
    keep = {"RSLURM_LOG_LEVEL", "RSLURM_CONTROL_DIR", *extra}
    return {k: v for k, v in env.items() if not k.startswith("RSLURM_") or k in keep}


def _submit(slurm: SlurmCluster, work: Path, template: str, sbatch: list[str], command: list[str],
            **env: str) -> tuple[subprocess.CompletedProcess[str], int | None]:
    argv = [PY, "-m", "resilient_slurm.cli", "submit", "--template", template, "-p", "low",
            "--gpus-per-node=0", "--cpus-per-task=1", "-t", "10", "--local-dir", str(work / "nvme" / "%n"),
            "-o", str(work / "job.out"), "--script-dir", str(work / "jobs"), *sbatch, "--", *command]
    cp = subprocess.run(argv, cwd=work, env=_job_env(slurm, work, **env), capture_output=True, text=True,
                        timeout=120)
    job = int(cp.stdout) if cp.returncode == 0 else None
    return cp, job


def _toy(work: Path, steps: int, *, sleep: float = 0.05, workers: int = 0, log: str = "log.%r.jsonl") -> list[str]:
    return [*TOY, "--steps", str(steps), "--every-steps", "4", "--workers", str(workers), "--step-sleep",
            str(sleep), "--log", str(work / log)]


def _work(slurm: SlurmCluster, name: str) -> Path:
    work = slurm.work_dir / f"templates-{name}"
    work.mkdir()
    return work


def _done(slurm: SlurmCluster, job: int | str, work: Path, timeout: float = 150) -> dict[str, str]:
    try:
        return slurm.wait_state(job, "COMPLETED", timeout=timeout)
    except BaseException:
        out = work / "job.out"
        print(out.read_text(errors="replace")[-6000:] if out.exists() else "(no job output)")
        raise


def _committed(work: Path, node: str, run_id: str, step: int) -> bool:
    return (work / "nvme" / node / run_id / f"step_{step:012d}" / "manifest.json").is_file()


def _starts_exits(log: Path) -> tuple[list[dict], list[dict]]:
    events = read_jsonl(log)
    return [e for e in events if e.get("event") == "start"], [e for e in events if e.get("event") == "exit"]


def _assert_every_step_once_in_order(log: Path, steps: int) -> None:
    """A resume neither skips nor repeats: the last record of each step, in order, is 1..steps."""
    seen = [e["step"] for e in read_jsonl(log) if "loss" in e]
    assert sorted(set(seen)) == list(range(1, steps + 1)), seen


def _wait_restarted(slurm: SlurmCluster, job: int, log: Path, starts: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while len(_starts_exits(log)[0]) < starts:
        info = slurm.job_info(job)
        assert info is not None and info["JobState"] not in ("FAILED", "CANCELLED", "COMPLETED"), info
        assert time.monotonic() < deadline, (info, log.read_text()[-2000:] if log.exists() else "")
        time.sleep(0.2)


@pytest.mark.slow
def test_single_node_template_saves_requeues_and_resumes_on_usr1(slurm: SlurmCluster):
    work = _work(slurm, "single")
    steps = 40
    cp, job = _submit(slurm, work, "single_node", ["--ntasks-per-node=2"], _toy(work, steps))
    assert job is not None, cp.stderr
    assert f"job {job} submitted" in cp.stderr
    script = Path(re.search(r"\((/.+\.sbatch)\)", cp.stderr).group(1))  # type: ignore[union-attr]
    assert script.parent == work / "jobs" and "set -- python -m resilient_slurm.examples.train_toy" in \
        script.read_text()
    assert slurm.job_info(job)["Command"] == str(script)  # type: ignore[index]
    wait_for_step(work / "log.0.jsonl", 6, timeout=90)
    slurm.scancel("--batch", "--signal=USR1", job)  # what --signal=B:USR1@grace sends before the time limit
    info = _done(slurm, job, work)
    assert int(info["Restarts"]) == 1, info
    node = info["NodeList"]
    for r in (0, 1):
        starts, exits = _starts_exits(work / f"log.{r}.jsonl")
        assert len(starts) == 2 and exits[0]["stopped"] is True, (starts, exits)
        assert starts[1]["step"] == exits[0]["step"] >= 6, (starts, exits)
        _assert_every_step_once_in_order(work / f"log.{r}.jsonl", steps)
    assert _committed(work, node, str(job), steps)
    text = (work / "job.out").read_text()
    assert text.count("control server listening") == 2, text[-3000:]  # both incarnations, one appended log


@pytest.mark.slow
def test_multi_node_template_runs_one_rank_per_node_to_completion(slurm: SlurmCluster):
    work = _work(slurm, "multi")
    steps = 16
    cp, job = _submit(slurm, work, "multi_node", ["--ntasks-per-node=1"], _toy(work, steps, sleep=0.0))
    assert job is not None, cp.stderr
    info = _done(slurm, job, work)
    assert info["NodeList"] == "n[1-2]" and int(info["Restarts"]) == 0, info
    for node in ("n1", "n2"):
        assert _committed(work, node, str(job), steps), node
    for r in (0, 1):
        _assert_every_step_once_in_order(work / f"log.{r}.jsonl", steps)


@pytest.mark.slow
def test_job_array_template_gives_every_task_its_own_run(slurm: SlurmCluster):
    work = _work(slurm, "array")
    steps = 12
    # A per-task argument: the command is quoted as given, so the task index is read at run time.
    per_task = "exec " + shlex.join(_toy(work, steps, sleep=0.0, log="PLACEHOLDER")).replace(
        shlex.quote(str(work / "PLACEHOLDER")), str(work) + "/log.task$SLURM_ARRAY_TASK_ID.jsonl")
    cp, job = _submit(slurm, work, "job_array", ["--array=0-1", "--ntasks-per-node=1"],
                      ["bash", "-c", per_task])
    assert job is not None, cp.stderr
    for task in (0, 1):
        info = _done(slurm, f"{job}_{task}", work)
        assert int(info["Restarts"]) == 0, info
    for task in (0, 1):
        run = f"{job}_{task}"
        assert any(_committed(work, n, run, steps) for n in ("n1", "n2")), run
        _assert_every_step_once_in_order(work / f"log.task{task}.jsonl", steps)
    assert (work / f"sweep-{job}_0.out").exists() is False  # -o given: both tasks append to job.out
    assert (work / "job.out").read_text().count("control server listening") == 2


@pytest.mark.slow
def test_torchrun_template_saves_and_resumes_on_usr1_and_on_a_slurm_sigterm(slurm: SlurmCluster):
    work = _work(slurm, "torchrun")
    steps = 60
    # n2's worker cannot reach the launcher's control socket (on a real cluster it lives on n1 only; on
    # this one-host cluster it would be reachable): it must learn of the save from the other rank.
    cut_off = ('if [ "$SLURMD_NODENAME" = n2 ]; then export RSLURM_CONTROL_SOCKET=off; fi; exec '
               + shlex.join(_toy(work, steps, sleep=0.1, workers=1)))
    cp, job = _submit(slurm, work, "multi_node_torchrun", [], ["bash", "-c", cut_off], NPROC_PER_NODE="1")
    assert job is not None, cp.stderr
    log0, log1 = work / "log.0.jsonl", work / "log.1.jsonl"
    wait_for_step(log0, 6, timeout=90)
    slurm.scancel("--batch", "--signal=USR1", job)  # to the launcher: it asks over the socket only
    _wait_restarted(slurm, job, log0, 2)
    resumed = _starts_exits(log0)[0][1]["step"]
    wait_for_step(log0, resumed + 6, timeout=90)
    slurm.scancel("--signal=TERM", job)  # Slurm's SIGTERM to every process of the step, not the launcher
    info = _done(slurm, job, work)
    assert int(info["Restarts"]) == 2, info
    for r, log in enumerate((log0, log1)):
        starts, exits = _starts_exits(log)
        assert len(starts) == 3 and [e["stopped"] for e in exits] == [True, True, False], (r, starts, exits)
        assert [s["step"] for s in starts[1:]] == [e["step"] for e in exits[:2]], (r, starts, exits)
        _assert_every_step_once_in_order(log, steps)
    # Both ranks saved the same steps, and each found its shards on its own node after the requeue.
    assert [e["step"] for e in _starts_exits(log0)[1]] == [e["step"] for e in _starts_exits(log1)[1]]
    text = (work / "job.out").read_text()
    assert text.count("restored step") == 4, text[-4000:]
    assert "rank 1 registered" not in text and text.count("rank 0 registered") == 3, text[-4000:]
    assert _committed(work, "n1", str(job), steps) and _committed(work, "n2", str(job), steps)


@pytest.mark.slow
def test_sbatch_failure_exits_1_with_its_message(slurm: SlurmCluster):
    work = _work(slurm, "fail")
    cp, job = _submit(slurm, work, "single_node", ["-p", "nosuchpartition"], ["python", "t.py"])
    assert job is None and cp.returncode == 1, (cp.returncode, cp.stdout, cp.stderr)
    assert "sbatch failed" in cp.stderr and "invalid partition" in cp.stderr.lower(), cp.stderr
    assert cp.stdout == "" and slurm.squeue() == []
    assert len(list((work / "jobs").iterdir())) == 1  # the script is kept for a look
