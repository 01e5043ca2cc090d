"""torchrun's variables for every task under ``rslurm launch -- srun`` (resilient_slurm/launcher/rank_env.py,
resilient_slurm/launcher/task_env.sh) and ``LOCAL_WORLD_SIZE`` from ``init_distributed``.

* the task prolog itself, run with the environment slurmstepd gives a task: what it exports from which
  Slurm variable (tasks-per-node forms ``2(x2)``, ``3,1``, ``1``; node lists), what it leaves alone;
* how the launcher rewrites the srun command and environment (the prolog added, the user's own chained,
  stale per-task variables dropped, ``MASTER_PORT`` derived unless set, the nodes' addresses passed on);
* on the real two-node Slurm cluster, whose node names are not host names: a torchrun-style program
  (tests/workers/torchrun_style.py, with its own ``os.environ.setdefault("MASTER_ADDR", ...)``) runs
  unchanged under ``rslurm launch -- srun -N2 -n4`` with nothing rendezvous-related set and all-reduces
  across the 4 tasks; and a second job checks the derived ``MASTER_ADDR`` (the node's NodeAddr), a
  user-set ``MASTER_PORT``, a value set for the step, an uneven layout and a chained user task prolog;
* ``init_distributed`` exports ``LOCAL_WORLD_SIZE`` (a real gloo group of two processes).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, clean_env, free_port
from slurm_cluster import SlurmCluster

from resilient_slurm.errors import ConfigError, PermanentSlurmError
from resilient_slurm.jobenv import job_master_port, tasks_on_node
from resilient_slurm.launcher.processes import SrunStep
from resilient_slurm.launcher.rank_env import (
    CHAIN_VAR,
    TASK_PROLOG,
    node_address_map,
    split_task_prolog,
    srun_with_rank_env,
)
from resilient_slurm.rendezvous import NODE_ADDRS_MAX, NODE_ADDRS_VAR, decode_node_addresses

PY = sys.executable
WORKER = str(REPO / "tests" / "workers" / "torchrun_style.py")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT")


# --------------------------------------------------------------------------- the task prolog, run directly
def _prolog(env: dict[str, str]) -> tuple[dict[str, str], list[str], str]:
    """Run task_env.sh as slurmstepd does (its path, no arguments, the task's environment, under /bin/sh):
    the ``export`` lines as a dict, the ``unset`` names, and everything it printed."""
    r = subprocess.run([str(TASK_PROLOG)], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    exports, unsets = {}, []
    for line in r.stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            exports[name] = value
        elif line.startswith("unset "):
            unsets.append(line[len("unset "):])
    return exports, unsets, r.stdout


TASK = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "77"}


def test_the_prolog_is_executable_and_posix_sh() -> None:
    assert os.access(TASK_PROLOG, os.X_OK)
    assert TASK_PROLOG.read_text().startswith("#!/bin/sh\n")
    r = subprocess.run(["git", "ls-files", "-s", str(TASK_PROLOG.relative_to(REPO))], cwd=REPO, capture_output=True,
                       text=True, timeout=30)
    if r.stdout:  # tracked: the mode bit must be in git too, or a checkout loses it
        assert r.stdout.startswith("100755"), r.stdout


@pytest.mark.proc
def test_the_prolog_exports_torchrun_variables_from_slurms() -> None:
    exports, unsets, _ = _prolog(TASK)
    assert exports == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                       "NODE_RANK": "1", "MASTER_ADDR": "n1"}
    assert unsets == []  # MASTER_PORT is the launcher's (srun's environment), not the prolog's


@pytest.mark.proc
@pytest.mark.parametrize(("tasks_per_node", "node", "local_world"), [
    ("2(x2)", "0", "2"), ("2(x2)", "1", "2"), ("3,1", "0", "3"), ("3,1", "1", "1"), ("1", "0", "1"),
    ("2(x3),1", "2", "2"), ("2(x3),1", "3", "1"), ("8", "0", "8"), ("4,2(x2),1", "3", "1"),
])
def test_the_prolog_reads_each_tasks_per_node_form(tasks_per_node: str, node: str, local_world: str) -> None:
    env = {**TASK, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": node}
    del env["SLURM_TASKS_PER_NODE"]
    exports, _, _ = _prolog(env)
    assert (exports["LOCAL_WORLD_SIZE"], exports["GROUP_RANK"], exports["NODE_RANK"]) == (local_world, node, node)
    # The same rule in Python, for init_distributed.
    assert str(tasks_on_node(tasks_per_node, int(node))) == local_world


@pytest.mark.proc
def test_the_step_variables_win_over_the_jobs() -> None:
    """In a step smaller than the job, SLURM_STEP_* describe the step; the job's are the fallback."""
    env = {**TASK, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_STEP_NODELIST": "n[2-3]",
           "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-3]"}
    exports, _, _ = _prolog(env)
    assert (exports["WORLD_SIZE"], exports["LOCAL_WORLD_SIZE"], exports["MASTER_ADDR"]) == ("3", "1", "n2")
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        del env[var]
    exports, _, _ = _prolog(env)
    assert (exports["WORLD_SIZE"], exports["LOCAL_WORLD_SIZE"], exports["MASTER_ADDR"]) == ("8", "4", "n1")


@pytest.mark.proc
@pytest.mark.parametrize(("nodelist", "first"), [
    ("n[1-2]", "n1"), ("gpu-[07-10],a1", "gpu-07"), ("a1,b2", "a1"), ("r[1-2]n[3,5]", "r1n3"),
    ("n[10-12,1]", "n10"), ("host", "host"), ("node[003-004]", "node003"),
])
def test_the_prolog_takes_the_first_host_of_the_step(nodelist: str, first: str) -> None:
    exports, _, _ = _prolog({**TASK, "SLURM_STEP_NODELIST": nodelist})
    assert exports["MASTER_ADDR"] == first


@pytest.mark.proc
def test_the_prolog_keeps_what_the_task_has() -> None:
    """A value set for the step (srun --export=ALL,NAME=value; MASTER_ADDR from the batch script) is the
    user's: not printed, so slurmstepd leaves it. An empty one counts as unset."""
    env = {**TASK, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "NODE_RANK": "7", "RANK": ""}
    exports, _, _ = _prolog(env)
    assert "MASTER_ADDR" not in exports and "MASTER_PORT" not in exports and "NODE_RANK" not in exports
    assert exports["RANK"] == "3" and exports["GROUP_RANK"] == "1"


@pytest.mark.proc
def test_the_prolog_takes_master_addr_from_the_launchers_node_addresses() -> None:
    """Node names need not be host names: the launcher hands the prolog each node's NodeAddr (only those that
    differ from the name), and every task gets the address of its step's first node. A node listed with no
    address gets no MASTER_ADDR; one not listed gets its name. The map is not left in the task's environment."""
    addrs = "n1=10.0.0.1 n10=10.0.0.10 gpu-st-7=fd00::7 n3="
    for step_nodes, want in (("n[1-2]", "10.0.0.1"), ("n[10-11]", "10.0.0.10"), ("gpu-st-[7-8]", "fd00::7"),
                             ("n2,n1", "n2"), ("n[3-4]", None), ("n1x", "n1x")):
        exports, unsets, _ = _prolog({**TASK, "SLURM_STEP_NODELIST": step_nodes, NODE_ADDRS_VAR: addrs})
        assert exports.get("MASTER_ADDR") == want, (step_nodes, exports)
        assert unsets == [NODE_ADDRS_VAR]
    # A MASTER_ADDR set for the step is the user's, map or not.
    exports, _, _ = _prolog({**TASK, "MASTER_ADDR": "head.example", NODE_ADDRS_VAR: addrs})
    assert "MASTER_ADDR" not in exports


@pytest.mark.proc
def test_the_prolog_outside_a_slurm_task_exports_nothing() -> None:
    exports, unsets, out = _prolog({"SLURM_JOB_ID": "5"})
    assert exports == {} and unsets == [] and out == ""


@pytest.mark.proc
def test_the_prolog_falls_back_to_one_on_a_tasks_per_node_it_cannot_read() -> None:
    for bad in ("x", "2(x", "2(xz)", ""):
        exports, _, _ = _prolog({**TASK, "SLURM_STEP_TASKS_PER_NODE": bad, "SLURM_TASKS_PER_NODE": bad})
        assert exports["LOCAL_WORLD_SIZE"] == "1", bad
    exports, _, _ = _prolog({**TASK, "SLURM_NODEID": "5"})  # no such node in 2(x2)
    assert exports["LOCAL_WORLD_SIZE"] == "1"


@pytest.mark.proc
def test_the_prolog_chains_the_users_prolog(tmp_path: Path) -> None:
    """The user's prolog runs last, sees our variables, its output follows ours (its exports win), and
    its exit status is the prolog's; our chaining variable is unset for the task."""
    user = tmp_path / "user_prolog.sh"
    user.write_text('#!/bin/sh\necho "export FROM_USER=rank$RANK-of-$WORLD_SIZE"\necho "export GROUP_RANK=42"\n'
                    'echo "print hello from the user"\nexit ${USER_EXIT:-0}\n')
    user.chmod(0o755)
    exports, unsets, out = _prolog({**TASK, CHAIN_VAR: str(user)})
    assert exports["FROM_USER"] == "rank3-of-4" and exports["GROUP_RANK"] == "42" and exports["RANK"] == "3"
    assert unsets == [CHAIN_VAR] and "print hello from the user" in out
    lines = out.splitlines()
    assert lines.index("export GROUP_RANK=42") > lines.index("export GROUP_RANK=1")
    r = subprocess.run([str(TASK_PROLOG)], env={**TASK, CHAIN_VAR: str(user), "USER_EXIT": "3"}, capture_output=True,
                       timeout=30)
    assert r.returncode == 3


def test_the_shell_rule_and_pythons_agree_on_malformed_lists() -> None:
    for bad in ("x", "2(x", "2(xz)", "", "2,,1"):
        with pytest.raises(ValueError):
            tasks_on_node(bad, 0 if bad != "2,,1" else 1)
    with pytest.raises(ValueError):
        tasks_on_node("2(x2)", 2)


# --------------------------------------------------------------------------- the launcher's srun command
@pytest.mark.parametrize(("argv", "kept", "prolog"), [
    (["srun", "-N2", "python", "t.py", "--task-prolog=x"], ["srun", "-N2", "python", "t.py", "--task-prolog=x"], None),
    (["srun", "--task-prolog=/p/a.sh", "-n2", "python"], ["srun", "-n2", "python"], "/p/a.sh"),
    (["srun", "--task-prolog", "/p/a.sh", "-n", "2", "python"], ["srun", "-n", "2", "python"], "/p/a.sh"),
    (["srun", "--task-p=/p/a", "--task-prolog=/p/b", "python"], ["srun", "python"], "/p/b"),
    (["srun", "-lN", "2", "--task-prolog=/p/a", "--", "python", "--task-prolog=/q"],
     ["srun", "-lN", "2", "--", "python", "--task-prolog=/q"], "/p/a"),
    (["srun", "--export", "ALL", "--task-prolog=/p/a", "python"], ["srun", "--export", "ALL", "python"], "/p/a"),
    (["srun", "-J", "--task-prolog=/p/a", "python"], ["srun", "-J", "--task-prolog=/p/a", "python"], None),
    (["srun", "--task-epilog=/p/e", "python"], ["srun", "--task-epilog=/p/e", "python"], None),
])
def test_split_task_prolog_finds_sruns_own_option_only(argv: list[str], kept: list[str], prolog: str | None) -> None:
    assert split_task_prolog(argv) == (kept, prolog)


BATCH = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]", "PATH": "/usr/bin:/bin"}


def test_srun_gets_the_prolog_first_and_a_derived_port() -> None:
    argv, env = srun_with_rank_env(["srun", "-N2", "-n4", "python", "train.py"], BATCH)
    assert argv == ["srun", f"--task-prolog={TASK_PROLOG}", "-N2", "-n4", "python", "train.py"]
    assert env["MASTER_PORT"] == str(job_master_port(4242)) == "19242"
    assert "MASTER_ADDR" not in env and CHAIN_VAR not in env  # MASTER_ADDR: the step's first host, per task


def test_user_set_master_vars_are_kept_and_stale_rank_vars_dropped(caplog: pytest.LogCaptureFixture) -> None:
    batch = {**BATCH, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1",
             "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "NODE_RANK": "0"}
    _, env = srun_with_rank_env(["srun", "python"], batch)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "29500")
    assert not any(v in env for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                       "NODE_RANK"))
    assert "RANK='0'" in caplog.text and "each task gets its own" in caplog.text
    assert batch["RANK"] == "0"  # the launcher's own environment is not changed


def test_the_users_prolog_is_chained_from_the_command_or_srun_variable() -> None:
    argv, env = srun_with_rank_env(["srun", "--task-prolog=/site/p.sh", "python"], BATCH)
    assert argv == ["srun", f"--task-prolog={TASK_PROLOG}", "python"] and env[CHAIN_VAR] == "/site/p.sh"
    argv, env = srun_with_rank_env(["srun", "python"], {**BATCH, "SLURM_TASK_PROLOG": "/site/q.sh"})
    assert argv == ["srun", f"--task-prolog={TASK_PROLOG}", "python"] and env[CHAIN_VAR] == "/site/q.sh"
    # The command line wins over the variable, as in srun.
    _, env = srun_with_rank_env(["srun", "--task-prolog=/site/p.sh", "python"], {**BATCH, "SLURM_TASK_PROLOG": "/q"})
    assert env[CHAIN_VAR] == "/site/p.sh"
    # Ours is never chained to itself; a stale chaining variable is not passed on.
    _, env = srun_with_rank_env(["srun", f"--task-prolog={TASK_PROLOG}", "python"], {**BATCH, CHAIN_VAR: "/old"})
    assert CHAIN_VAR not in env


def test_srun_gets_the_node_addresses_unless_the_user_set_master_addr(caplog: pytest.LogCaptureFixture) -> None:
    addrs = {"n1": "10.0.0.1", "n2": "n2", "n3": None}
    _, env = srun_with_rank_env(["srun", "python"], {**BATCH, NODE_ADDRS_VAR: "stale"}, addrs)
    assert decode_node_addresses(env[NODE_ADDRS_VAR]) == {"n1": "10.0.0.1", "n3": ""}  # n2 resolves as itself
    _, env = srun_with_rank_env(["srun", "python"], {**BATCH, "MASTER_ADDR": "10.9.9.9", NODE_ADDRS_VAR: "stale"},
                                addrs)
    assert NODE_ADDRS_VAR not in env and env["MASTER_ADDR"] == "10.9.9.9"
    # Past the size one environment string may have, the first nodes (where task 0 runs) are kept.
    many = {f"node{i:05d}": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(5000)}
    _, env = srun_with_rank_env(["srun", "python"], BATCH, many)
    kept = decode_node_addresses(env[NODE_ADDRS_VAR])
    assert len(env[NODE_ADDRS_VAR]) <= NODE_ADDRS_MAX and "node00000" in kept and len(kept) < 5000
    assert "cannot carry the address of node(s) node0" in caplog.text


def test_node_address_map_prefers_slurms_node_addr_then_a_name_that_resolves(
        caplog: pytest.LogCaptureFixture) -> None:
    resolvable = {"login1"}

    def resolve(host: str) -> str | None:
        return None if host in resolvable else "Name or service not known"

    addrs = node_address_map(["n1", "n2", "login1"], lambda: {"n1": "10.0.0.1"}, resolve)
    assert addrs == {"n1": "10.0.0.1", "n2": None, "login1": "login1"}
    assert "no rendezvous address for node(s) n2" in caplog.text and "MASTER_ADDR" in caplog.text

    def no_slurm() -> dict[str, str]:
        raise PermanentSlurmError("scontrol: error: no controller")

    caplog.clear()
    nodes = [f"n{i}" for i in range(40)]
    addrs = node_address_map(nodes, no_slurm, resolve)
    assert "cannot read the nodes' addresses from Slurm (scontrol: error: no controller)" in caplog.text
    # The first nodes' names are checked (n0 does not resolve); beyond those, the name is left as it is.
    assert addrs["n0"] is None and addrs["n39"] == "n39"


def test_srun_step_runs_the_rewritten_command() -> None:
    step = SrunStep(["srun", "-n2", "true"], BATCH)
    assert step.argv[:2] == ["srun", f"--task-prolog={TASK_PROLOG}"] and step.env["MASTER_PORT"] == "19242"


# --------------------------------------------------------------------------- the real Slurm cluster
def _batch_script(work: Path, srun: list[str], env: dict[str, str], *, rsrun: bool = False) -> str:
    """``exec rslurm launch -- srun SRUN...`` (``rsrun``: ``exec bin/rsrun SRUN...``, the drop-in)."""
    base = {"PYTHONPATH": str(REPO), "PYTHON": PY, "OMP_NUM_THREADS": "1", "RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"),
            "RSLURM_RUN_ID": "rankenv", "RSLURM_LOG_LEVEL": "INFO",
            # Test clusters that run at the same time may number jobs alike: keep their sockets apart.
            "RSLURM_CONTROL_DIR": str(work.parent.parent / "ctl"), **env}
    exports = "".join(f"export {k}='{v}'\n" for k, v in base.items())
    launcher = [str(REPO / "bin" / "rsrun")] if rsrun else [PY, "-m", "resilient_slurm.cli", "launch", "--", "srun"]
    return f"#!/bin/bash\n{exports}exec {' '.join([*launcher, *srun])}\n"


def _run_job(slurm: SlurmCluster, work: Path, script: str, *sbatch: str) -> None:
    job = slurm.sbatch(script, "-p", "low", "-N2", "--exclusive", "-o", str(work / "job.out"), *sbatch)
    try:
        slurm.wait_state(job, "COMPLETED", timeout=180)
    except BaseException:
        print((work / "job.out").read_text(errors="replace")[-6000:] if (work / "job.out").exists() else "")
        raise


@pytest.mark.proc
def test_a_torchrun_style_program_runs_unchanged_under_rslurm_launch_srun(slurm: SlurmCluster) -> None:
    """2 nodes x 2 tasks: each task defaults MASTER_ADDR/MASTER_PORT to localhost:29500 with
    ``os.environ.setdefault`` (as a program written for one machine does), reads torchrun's variables at
    import, forms a gloo group with env:// and all-reduces. Nothing rendezvous-related is set: the emulated
    nodes n1, n2 are names only Slurm knows, and every task gets n1's NodeAddr (127.0.0.1) and the port
    derived from the job id, which the program's defaults do not override. RANK and WORLD_SIZE left over
    in the batch script are stale and must not reach the tasks."""
    work = slurm.work_dir / "rankenv-torchrun-style"
    (work / "out").mkdir(parents=True)
    script = _batch_script(work, ["-N2", "-n4", PY, WORKER, str(work / "out"), CHAIN_VAR, NODE_ADDRS_VAR],
                           {"RANK": "0", "WORLD_SIZE": "1"})
    job_out = work / "job.out"
    _run_job(slurm, work, script, "-n4")
    records = {int(p.stem[len("rank"):]): json.loads(p.read_text()) for p in (work / "out").glob("rank*.json")}
    assert sorted(records) == [0, 1, 2, 3], job_out.read_text()
    job_id = records[0]["slurm"]["SLURM_JOB_ID"]
    port = str(job_master_port(int(job_id)))
    for rank, rec in records.items():
        saw, sl = rec["saw"], rec["slurm"]
        node = rank // 2  # block distribution: tasks 0,1 on n1, 2,3 on n2
        assert saw == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": str(node), "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port}, rec
        assert (sl["SLURM_PROCID"], sl["SLURM_LOCALID"], sl["SLURM_NODEID"], sl["SLURMD_NODENAME"]) == (
            str(rank), str(rank % 2), str(node), f"n{node + 1}")
        assert rec["group"] == [rank, 4] and rec["sum"] == 10.0  # 1 + 2 + 3 + 4
        assert rec["extra"] == {CHAIN_VAR: None, NODE_ADDRS_VAR: None}
    text = job_out.read_text()
    assert f"--task-prolog={TASK_PROLOG}" in text and "not passing RANK='0', WORLD_SIZE='1'" in text
    assert "(NodeAddr; n1 -> 127.0.0.1)" in text
    assert "completed: every rank exited 0" in text


@pytest.mark.proc
def test_derived_master_addr_user_values_and_a_chained_prolog_on_the_cluster(slurm: SlurmCluster) -> None:
    """Through bin/rsrun: 3 tasks on 2 nodes (2 + 1) with the user's own --task-prolog, NODE_RANK set for the step with
    --export, MASTER_PORT set in the batch script, MASTER_ADDR not set: every task gets the address of the
    step's first node as Slurm knows it (n1's NodeAddr, 127.0.0.1), the user's port, NODE_RANK=7, the right LOCAL_WORLD_SIZE per node, and the user's prolog
    ran after ours (it saw RANK; its GROUP_RANK wins)."""
    work = slurm.work_dir / "rankenv-chained"
    (work / "out").mkdir(parents=True)
    user = work / "user_prolog.sh"
    user.write_text('#!/bin/sh\necho "export FROM_USER=rank$RANK-lws$LOCAL_WORLD_SIZE"\necho "export GROUP_RANK=42"\n')
    user.chmod(0o755)
    dump = f'env > {work}/out/env.$SLURM_PROCID'
    script = _batch_script(work, ["-N2", "-n3", "--export=ALL,NODE_RANK=7", f"--task-prolog={user}", "sh", "-c",
                                  f"'{dump}'"], {"MASTER_PORT": "23456", "LOCAL_RANK": "9"}, rsrun=True)
    _run_job(slurm, work, script, "-n4")
    envs = {}
    for p in (work / "out").glob("env.*"):
        envs[int(p.suffix[1:])] = dict(line.split("=", 1) for line in p.read_text().splitlines() if "=" in line)
    assert sorted(envs) == [0, 1, 2], (work / "job.out").read_text()
    lws = {0: "2", 1: "2", 2: "1"}
    for rank, env in envs.items():
        assert {k: env.get(k) for k in TORCHRUN_VARS} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": lws[rank],
            "GROUP_RANK": "42", "NODE_RANK": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"}, env
        assert env["FROM_USER"] == f"rank{rank}-lws{lws[rank]}" and CHAIN_VAR not in env and NODE_ADDRS_VAR not in env


# --------------------------------------------------------------------------- init_distributed
CHILD = """
import json, os
from resilient_slurm.distributed import init_distributed
rank, world, local = init_distributed(timeout=60)
print(json.dumps({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT")}))
"""


def _init_in_two_processes(per_rank: list[dict[str, str]]) -> list[dict[str, str]]:
    procs = [subprocess.Popen([PY, "-c", CHILD], env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for env in per_rank]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.proc
def test_init_distributed_exports_local_world_size_from_slurm() -> None:
    port = str(free_port())
    job = str(random.randint(1, 10**6))
    seen = _init_in_two_processes([
        {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(r),
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_JOB_NODELIST": "127.0.0.1",
         "SLURM_JOB_ID": job, "MASTER_PORT": port} for r in range(2)])
    for r, env in enumerate(seen):
        assert env == {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


@pytest.mark.proc
def test_init_distributed_keeps_a_set_local_world_size() -> None:
    port = str(free_port())
    seen = _init_in_two_processes([
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": port, "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "0"} for r in range(2)])
    assert [e["LOCAL_WORLD_SIZE"] for e in seen] == ["2", "2"]


def test_local_world_size_rules(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from resilient_slurm.distributed import local_world_size

    assert local_world_size({}) == 1
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "SLURM_TASKS_PER_NODE": "2"}) == 4
    assert local_world_size({"SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}) == 1
    assert local_world_size({"SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "0"}) == 3
    assert local_world_size({"SLURM_TASKS_PER_NODE": "3,1"}) == 3  # no SLURM_NODEID: the first node
    assert local_world_size({"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "4", "SLURM_NODEID": "1"}) == 2
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        local_world_size({"LOCAL_WORLD_SIZE": "two"})
    assert local_world_size({"SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "5"}) == 1
    assert "has no node 5" in caplog.text


@pytest.mark.proc
def test_the_only_task_of_a_step_needs_no_group_even_with_the_prologs_variables() -> None:
    """A one-task srun step under the launcher has RANK=0/WORLD_SIZE=1 from the prolog: still no process
    group (and no port), as for a plain one-task step; a torchrun worker keeps its group of one."""
    pytest.importorskip("torch")
    from resilient_slurm.distributed import resolve_distributed_env

    task = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "9", "SLURM_STEP_NODELIST": "n1"}
    exports, _, _ = _prolog({**task, "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODEID": "0"})
    assert resolve_distributed_env({**task, **exports, "MASTER_PORT": "15009"}) is None
    torchrun = {**task, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "15009",
                "TORCHELASTIC_RUN_ID": "none"}
    resolved = resolve_distributed_env(torchrun)
    assert resolved is not None and resolved.world_size == 1 and resolved.source == "torchrun"
