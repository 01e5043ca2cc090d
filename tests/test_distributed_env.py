"""init_distributed: node-list expansion, environment precedence, and real 2-process gloo groups."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from ports import free_port

from resilient_slurm.distributed import (
    DistributedEnv,
    expand_nodelist,
    init_distributed,
    parse_nodelist,
    resolve_distributed_env,
)
from resilient_slurm.errors import ConfigError, RendezvousError

REPO_ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# -- node lists -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("localhost", ["localhost"]),
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("gpu-[01-04]", ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]),
        ("a1,b2", ["a1", "b2"]),
        ("node[7]", ["node7"]),
        ("n[1-2],gpu[08-10]", ["n1", "n2", "gpu08", "gpu09", "gpu10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("c1.example.org,c[2-3].example.org", ["c1.example.org", "c2.example.org", "c3.example.org"]),
    ],
)
def test_parse_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist", ["", "n[1-3", "n1-3]", "n[3-1]", "n[a-b]", "n[1,,2]", "[1-2]", "a,,b", "n[[1]]"]
)
def test_parse_nodelist_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(ConfigError, match="node list"):
        parse_nodelist(nodelist)


def _fake_scontrol(tmp_path: Path, body: str) -> Path:
    """A stand-in scontrol executable, so the real subprocess code path runs."""
    script = tmp_path / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.proc
def test_expand_nodelist_uses_scontrol(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path, "printf 'alpha\\nbeta\\n'")
    assert expand_nodelist("x[1-2]", scontrol=str(scontrol)) == ["alpha", "beta"]
    assert (tmp_path / "calls").read_text().split() == ["show", "hostnames", "x[1-2]"]


def test_expand_nodelist_skips_scontrol_for_plain_lists(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path, "echo wrong")
    assert expand_nodelist("a1,b2", scontrol=str(scontrol)) == ["a1", "b2"]
    assert not (tmp_path / "calls").exists()


@pytest.mark.proc
@pytest.mark.parametrize("body", ["echo 'slurm_load_ctl_conf error' >&2; exit 1", "exec sleep 30", "true"])
def test_expand_nodelist_falls_back_when_scontrol_fails_hangs_or_says_nothing(
    tmp_path: Path, body: str
) -> None:
    scontrol = _fake_scontrol(tmp_path, body)
    assert expand_nodelist("gpu-[01-02]", scontrol=str(scontrol), timeout_s=1.0) == ["gpu-01", "gpu-02"]
    assert (tmp_path / "calls").exists()


@pytest.mark.proc
def test_expand_nodelist_falls_back_when_scontrol_is_missing(tmp_path: Path) -> None:
    assert expand_nodelist("n[1-2]", scontrol=str(tmp_path / "no-such-scontrol")) == ["n1", "n2"]


# -- environment resolution -----------------------------------------------------------------------


def _hosts_of(nodelist: str) -> list[str]:
    return parse_nodelist(nodelist)


SLURM_ENV = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu-[07-10]",
    "SLURM_JOB_ID": "123456",
}


@pytest.mark.proc
def test_slurm_variables_are_mapped() -> None:
    resolved = resolve_distributed_env(SLURM_ENV, expand=_hosts_of)
    assert resolved == DistributedEnv(3, 8, 1, "gpu-07", 15000 + 123456 % 17000, "slurm")


@pytest.mark.proc
def test_step_nodelist_wins_over_job_nodelist_and_master_vars_win_over_both() -> None:
    env = {**SLURM_ENV, "SLURM_STEP_NODELIST": "gpu-[09-10]"}
    resolved = resolve_distributed_env(env, expand=_hosts_of)
    assert resolved is not None and resolved.master_addr == "gpu-09"
    env.update(MASTER_ADDR="10.0.0.5", MASTER_PORT="29500")
    resolved = resolve_distributed_env(env, expand=_hosts_of)
    assert resolved is not None and (resolved.master_addr, resolved.master_port) == ("10.0.0.5", 29500)


def test_torchrun_variables_take_precedence_over_slurm() -> None:
    env = {
        **SLURM_ENV,
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "2",
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29400",
    }
    assert resolve_distributed_env(env, expand=_hosts_of) == DistributedEnv(
        5, 6, 2, "head", 29400, "torchrun"
    )


def test_no_distributed_environment_resolves_to_none() -> None:
    assert resolve_distributed_env({}) is None
    assert resolve_distributed_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}) is None
    # A single-task Slurm step (e.g. python in the batch script) needs no process group.
    single = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9"}
    assert resolve_distributed_env(single) is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID"),
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS"),
        ({"SLURM_LOCALID": "-1"}, "SLURM_LOCALID"),
        ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_NODELIST": "gpu-[07-"}, "SLURM_JOB_NODELIST"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "zero"}, "LOCAL_RANK"),
    ],
)
@pytest.mark.proc
def test_malformed_variables_raise_config_error_naming_them(change: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_distributed_env({**SLURM_ENV, **change}, expand=_hosts_of)


def test_missing_slurm_localid_and_missing_rendezvous_raise() -> None:
    env = dict(SLURM_ENV)
    del env["SLURM_LOCALID"]
    with pytest.raises(ConfigError, match="SLURM_LOCALID"):
        resolve_distributed_env(env, expand=_hosts_of)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        resolve_distributed_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        resolve_distributed_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_the_rendezvous_address_is_the_first_nodes_node_addr() -> None:
    """Node names need not be host names: Slurm's NodeAddr of the first node is the address; the name only
    when Slurm gives none; a MASTER_ADDR that is set is used without asking Slurm."""
    asked: list[str] = []

    def node_addr(node: str) -> str | None:
        asked.append(node)
        return {"gpu-07": "10.1.0.7"}.get(node)

    resolved = resolve_distributed_env(SLURM_ENV, expand=_hosts_of, node_addr=node_addr)
    assert resolved is not None and resolved.master_addr == "10.1.0.7" and asked == ["gpu-07"]
    assert resolved.addr_source == "NodeAddr of node gpu-07, the first of SLURM_JOB_NODELIST, from Slurm"
    resolved = resolve_distributed_env({**SLURM_ENV, "SLURM_STEP_NODELIST": "gpu-[09-10]"}, expand=_hosts_of,
                                       node_addr=node_addr)
    assert resolved is not None and resolved.master_addr == "gpu-09"
    assert "Slurm gave no NodeAddr" in resolved.addr_source
    asked.clear()
    resolved = resolve_distributed_env({**SLURM_ENV, "MASTER_ADDR": "10.0.0.5"}, expand=_hosts_of, node_addr=node_addr)
    assert resolved is not None and resolved.master_addr == "10.0.0.5" and asked == []


@pytest.mark.parametrize(("env", "words"), [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "rdzv-host.invalid", "MASTER_PORT": "29511"},
     ["rank 1 of 2", "'rdzv-host.invalid' (port 29511; from MASTER_ADDR, set in the environment) does not resolve"]),
    # Outside the launcher, with no NodeAddr from Slurm (no cluster here), the first node's name is tried.
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n1-nowhere.invalid",
      "SLURM_JOB_ID": "42"},
     ["rank 0 of 2", "'n1-nowhere.invalid' (port 15042; from node n1-nowhere.invalid, the first of "
      "SLURM_JOB_NODELIST: Slurm gave no NodeAddr for it) does not resolve"]),
], ids=["set by the user", "derived"])
@pytest.mark.proc
def test_an_address_that_does_not_resolve_is_said_at_once(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                          words: list[str]) -> None:
    """Instead of torch's retries for the whole timeout: one error that names the address, the port, where
    the address came from and what to set; nothing is exported and no group is created."""
    for name in list(os.environ):
        if name in DIST_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RendezvousError) as err:
        init_distributed(timeout=5)
    for w in [*words, "Set MASTER_ADDR to an address of the node that runs rank 0", "rslurm launch -- srun"]:
        assert w in str(err.value), (w, str(err.value))
    assert not dist.is_initialized() and "LOCAL_WORLD_SIZE" not in os.environ
    assert isinstance(err.value, ConfigError)  # what init_distributed raised for a bad environment before


@pytest.mark.proc
def test_a_rendezvous_where_nothing_answers_is_a_rendezvous_error() -> None:
    """Rank 1 of 2 and nothing listening at the port: torch's store gives up after the timeout, and the
    error says where it tried and what to set (a real process, a real socket)."""
    port = free_port()
    env = _clean_env()
    env.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = ("from resilient_slurm.distributed import init_distributed\n"
            "from resilient_slurm.errors import RendezvousError\n"
            "try:\n    init_distributed(timeout=2)\n"
            "except RendezvousError as e:\n    print('RendezvousError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"rank 1 of 2 could not meet the other ranks at 127.0.0.1:{port}" in r.stdout, r.stdout
    assert "Set MASTER_ADDR" in r.stdout


def test_init_distributed_without_environment_creates_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in DIST_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    assert not dist.is_initialized()
    assert init_distributed() == (0, 1, 0)
    assert not dist.is_initialized()
    assert "MASTER_PORT" not in os.environ


# -- real process groups --------------------------------------------------------------------------

CHILD = """
import json, os, sys
import torch, torch.distributed as dist
from resilient_slurm.distributed import init_distributed
rank, world, local = init_distributed(timeout=30)
again = init_distributed()  # already initialized: same answer, no second group
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(json.dumps({
    "rank": rank, "world": world, "local": local, "again": list(again), "sum": value.item(),
    "backend": dist.get_backend(), "addr": os.environ["MASTER_ADDR"], "port": os.environ["MASTER_PORT"],
}))
dist.destroy_process_group()
"""


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _run_ranks(envs: list[dict[str, str]]) -> list[dict[str, object]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for env in envs
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, f"rank process failed:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.proc
def test_two_slurm_tasks_form_a_gloo_group() -> None:
    port = free_port()
    job_id = str(random.randint(1, 10**7))
    envs = []
    for rank in range(2):
        env = _clean_env()
        env.update(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(rank),
            SLURM_JOB_NODELIST="localhost",
            SLURM_JOB_ID=job_id,
            # Explicit, so parallel test runs never collide on the port derived from the job id.
            MASTER_PORT=str(port),
        )
        envs.append(env)
    results = _run_ranks(envs)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["local"] == r["rank"]
        assert r["again"] == [r["rank"], 2, r["local"]]
        assert r["sum"] == 3.0
        assert r["backend"] == "gloo"
        assert (r["addr"], r["port"]) == ("localhost", str(port))


@pytest.mark.proc
def test_torchrun_variables_win_in_a_real_group() -> None:
    port = free_port()
    envs = []
    for rank in range(2):
        env = _clean_env()
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            # Contradicting Slurm variables: a group of 5 with swapped ranks would never form.
            SLURM_PROCID=str(1 - rank),
            SLURM_NTASKS="5",
            SLURM_LOCALID="4",
            SLURM_JOB_NODELIST="nowhere[1-5]",
            SLURM_JOB_ID="1",
        )
        envs.append(env)
    results = _run_ranks(envs)
    for r in results:
        assert r["world"] == 2 and r["local"] == r["rank"] and r["sum"] == 3.0
        assert (r["addr"], r["port"]) == ("127.0.0.1", str(port))
