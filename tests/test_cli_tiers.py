"""The inspection CLI (``rslurm ls / show / verify / gc / export``) on the node-local tier, a POSIX durable
tier and an S3 durable tier (moto's server over real HTTP on loopback).

The checkpoints are real: ``resilient_slurm.examples.train_toy`` trains once per module with two ranks
that emulate two nodes (``RSLURM_NODE_NAME`` n1 and n2, ``RSLURM_LOCAL_DIR=<dir>/nvme/%n``, DDP over
gloo), committing steps 3, 6, 9 and 12, and writes its final state (the reference). Real ``rslurm
daemon --once`` processes, one per node, drain them into a POSIX directory and into an S3 bucket. Each
test works on its own copy (directory tree or bucket) and runs ``rslurm`` as a real process.

In the durable-tier cases the local tier is empty (the nodes are gone), so every command finds the
steps in the durable tier by itself; one test combines both tiers.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3_support
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same, clean_env, free_port, run_ranks, sdir
from s3_support import MotoServer
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from resilient_slurm.examples.train_toy import build as build_toy
from resilient_slurm.manifest import Manifest

RUN = "toy"
STEPS = (3, 6, 9, 12)
NODES = ("n1", "n2")
PREFIX = "ckpt"  # the S3 tier's key prefix in its bucket

moto_server = s3_support.moto_server

pytestmark = [
    pytest.mark.proc,  # every test here starts processes (tests/check_tier.py)
    pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo, flock, xattrs as on Linux"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


# --------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks on two emulated nodes train 12 steps, committing every 3 (retention keeps all four)."""
    root = tmp_path_factory.mktemp("trained")
    env = {"RSLURM_LOCAL_DIR": str(root / "nvme" / "%n"), "RSLURM_RUN_ID": RUN, "RSLURM_CONTROL_SOCKET": "off",
           "RSLURM_COLLECTIVE_TIMEOUT": "60", "RSLURM_KEEP_LAST": "10"}
    argv = ["-m", "resilient_slurm.examples.train_toy", "--steps", "12", "--every-steps", "3", "--workers", "0",
            "--out", str(root / "out.%r.pt")]
    run_ranks(argv, 2, root, env=env, per_rank_env=[{"RSLURM_NODE_NAME": n} for n in NODES], timeout=240)
    for n in NODES:
        assert sorted(p.name for p in (root / "nvme" / n / RUN).glob("step_*")) == [sdir(s) for s in STEPS]
    return root


def _drain(trained: Path, work: Path, durable: dict[str, str]) -> None:
    """Each node's ``rslurm daemon --once`` drains its domain (from a scratch copy: the daemon keeps its
    state in the local root)."""
    nvme = work / "nvme"
    shutil.copytree(trained / "nvme", nvme)
    for node in NODES:
        r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], capture_output=True,
                           text=True, timeout=120,
                           env=clean_env({"RSLURM_LOCAL_DIR": str(nvme / "%n"), "RSLURM_NODE_NAME": node,
                                          "RSLURM_LOCAL_MIN_FREE": "1M", "RSLURM_KEEP_LAST": "10", **durable}))
        assert r.returncode == 0, r.stderr
    assert "step 12 is durable" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def posix_pristine(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("posix")
    _drain(trained, work, {"RSLURM_DURABLE": str(work / "lustre")})
    return work / "lustre"


@pytest.fixture(scope="module")
def s3_pristine(trained: Path, moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    bucket = moto_server.new_bucket()
    _drain(trained, tmp_path_factory.mktemp("s3"), {"RSLURM_DURABLE": f"s3://{bucket}/{PREFIX}",
                                                    "RSLURM_S3_ENDPOINT_URL": moto_server.endpoint,
                                                    "RSLURM_S3_PART_SIZE": "5M"})
    return bucket


@dataclass
class Tiers:
    """One test's copy of the checkpoints in the tier under test, and ``rslurm`` pointed at it."""

    kind: str  # local | posix | s3
    nvme: Path  # the local tier: nvme/<node>
    lustre: Path | None = None
    bucket: str | None = None
    server: MotoServer | None = None

    @property
    def env(self) -> dict[str, str]:
        env = {"RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_DIR": str(self.nvme / "%n")}
        if self.lustre is not None:
            env["RSLURM_DURABLE"] = str(self.lustre)
        if self.bucket is not None:
            assert self.server is not None
            env.update(RSLURM_DURABLE=f"s3://{self.bucket}/{PREFIX}", RSLURM_S3_ENDPOINT_URL=self.server.endpoint)
        return env

    def rslurm(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "resilient_slurm.cli", *args], capture_output=True, text=True,
                              timeout=180, env=clean_env({**self.env, **env}))

    # Names of files in the tier under test, relative to it: nvme/ (local), the POSIX root, or the S3 prefix.
    def shard(self, step: int, rank: int) -> str:
        return (f"{NODES[rank]}/" if self.kind == "local" else "") + f"{RUN}/{sdir(step)}/__{rank}_0.distcp"

    def manifest(self, step: int) -> str:
        return ("n1/" if self.kind == "local" else "") + f"{RUN}/{sdir(step)}/manifest.json"

    def marker(self, step: int, node: str) -> str:
        if self.kind == "local":
            return f"{node}/{RUN}/{sdir(step)}/manifest.json"
        return f"{RUN}/{sdir(step)}/domains/{node}/manifest.json"

    def shown(self, name: str) -> str:
        """How rslurm names a file in its messages."""
        if self.kind == "s3":
            return f"s3://{self.bucket}/{PREFIX}/{name}"
        return str((self.nvme if self.kind == "local" else self.lustre) / name)  # type: ignore[operator]

    def _path(self, name: str) -> Path:
        return (self.nvme if self.kind == "local" else self.lustre) / name  # type: ignore[operator]

    def read(self, name: str) -> bytes:
        if self.kind == "s3":
            assert self.server is not None
            return self.server.client().get_object(Bucket=self.bucket, Key=f"{PREFIX}/{name}")["Body"].read()
        return self._path(name).read_bytes()

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "s3":
            assert self.server is not None
            self.server.client().put_object(Bucket=self.bucket, Key=f"{PREFIX}/{name}", Body=data)
        else:
            self._path(name).write_bytes(data)

    def delete(self, name: str) -> None:
        if self.kind == "s3":
            assert self.server is not None
            self.server.client().delete_object(Bucket=self.bucket, Key=f"{PREFIX}/{name}")
        else:
            self._path(name).unlink()

    def exists(self, name: str) -> bool:
        if self.kind == "s3":
            assert self.server is not None
            return "Contents" in self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{name}")
        return self._path(name).exists()


def _copy_bucket(server: MotoServer, src: str) -> str:
    dst = server.new_bucket()
    c = server.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=src):
        for o in page.get("Contents", []):
            c.copy_object(Bucket=dst, Key=o["Key"], CopySource={"Bucket": src, "Key": o["Key"]})
    return dst


@pytest.fixture(params=["local", "posix", "s3"])
def tiers(request: pytest.FixtureRequest, trained: Path, tmp_path: Path) -> Iterator[Tiers]:
    """The tier under test with its own copy of the checkpoints; for a durable tier, an empty local tier."""
    if request.param == "local":
        shutil.copytree(trained / "nvme", tmp_path / "nvme")
        yield Tiers("local", tmp_path / "nvme")
    elif request.param == "posix":
        shutil.copytree(request.getfixturevalue("posix_pristine"), tmp_path / "lustre")
        yield Tiers("posix", tmp_path / "nvme", lustre=tmp_path / "lustre")
    else:
        server = request.getfixturevalue("moto_server")
        yield Tiers("s3", tmp_path / "nvme", bucket=_copy_bucket(server, request.getfixturevalue("s3_pristine")),
                    server=server)


def ok_json(r: subprocess.CompletedProcess[str]) -> Any:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def reference(trained: Path, rank: int) -> dict[str, Any]:
    """What the training program saved at the end (step 12) on ``rank``."""
    return torch.load(trained / f"out.{rank}.pt", weights_only=True)


def flip_byte(t: Tiers, name: str) -> None:
    data = bytearray(t.read(name))
    data[len(data) // 2] ^= 0xFF
    t.write(name, bytes(data))


# --------------------------------------------------------------------------------------------- ls, show
def test_ls_and_show(tiers: Tiers, trained: Path) -> None:
    durable = tiers.kind != "local"
    doc = ok_json(tiers.rslurm("ls", "--json"))
    assert doc["durable"] == (tiers.env.get("RSLURM_DURABLE") if durable else None)
    assert doc["errors"] == []
    rows = {r["step"]: r for r in doc["steps"]}
    assert sorted(rows) == list(STEPS)
    m12 = Manifest.from_json((trained / "nvme" / "n1" / RUN / sdir(12) / "manifest.json").read_bytes())
    for r in rows.values():
        assert (r["run_id"], r["reason"], r["world_size"], r["domains"]) == (RUN, "interval", 2, ["n1", "n2"])
        assert r["age_s"] >= 0 and r["bytes"] > 0
        if durable:
            assert r["local"]["state"] == "absent" and r["durable"]["state"] == "durable", r
        else:
            assert r["local"]["state"] == "complete" and r["local"]["domains"] == ["n1", "n2"] and r["durable"] is None
    assert rows[12]["bytes"] == m12.total_bytes
    table = tiers.rslurm("ls")
    assert table.returncode == 0, table.stderr
    lines = [ln for ln in table.stdout.splitlines() if ln.split()[:2] in ([RUN, str(s)] for s in STEPS)]
    assert len(lines) == 4 and all(("durable" if durable else "complete") in ln for ln in lines), table.stdout

    # The newest step of the only run: neither needs to be named.
    show = ok_json(tiers.rslurm("show", "--json"))
    assert (show["run_id"], show["step"], show["tier"]) == (RUN, 12, "durable" if durable else "local")
    assert [(s["rank"], s["domain"], s["path"]) for s in show["shards"]] == [
        (0, "n1", "__0_0.distcp"), (1, "n2", "__1_0.distcp")]
    # What each shard takes where it is read from: the file's size, or a compressed object's (S3 compresses
    # by default, where it pays: storage.encoding).
    for s in show["shards"]:
        assert (s["stored_bytes"] == s["bytes"]) if tiers.kind != "s3" else (0 < s["stored_bytes"] <= s["bytes"]), s
    assert show["stored_bytes"] == sum(s["stored_bytes"] for s in show["shards"])
    keys = {k["key"]: k for k in show["keys"]}
    assert set(keys) == {"model", "optimizer", "scheduler", "scaler", "sampler", "progress"}
    assert show["ddp_bucket_layout"] is True and all(not k["per_rank"] for k in keys.values())
    ref = reference(trained, 0)
    assert keys["model"]["tensors"] == len(ref["model"]) and keys["model"]["dtypes"] == ["float32"]
    assert keys["model"]["tensor_bytes"] == sum(t.numel() * t.element_size() for t in ref["model"].values())
    assert show["rng"]["present"] and show["rng"]["ranks"] == ["rank0", "rank1"] and show["rng"]["missing_ranks"] == []
    assert {"python", "torch_cpu"} <= set(show["rng"]["generators"]["rank1"])
    [pos] = show["data_position"]
    assert (pos["key"], pos["kind"]) == ("sampler", "ResumableSampler")
    if tiers.kind == "s3":  # values would need a download: only their presence is shown
        assert pos["values"] == {} and show["notes"]
    else:  # read in place, checked against the item's checksum
        assert pos["values"]["consumed"] == ref["progress"]["samples_seen"] == 192
        assert pos["values"]["num_replicas"] == 2
    if tiers.kind == "local":  # the same document as a table (torch's import makes each call cost seconds)
        human = tiers.rslurm("show", "12")
        assert human.returncode == 0, human.stderr
        assert "RNG state: 2 of 2 ranks" in human.stdout and "sampler (ResumableSampler)" in human.stdout
        assert "__1_0.distcp" in human.stdout and "storage domains: n1 ranks [0]; n2 ranks [1]" in human.stdout


# --------------------------------------------------------------------------------------------- verify
def test_verify_names_every_damaged_file(tiers: Tiers, tmp_path: Path) -> None:
    # (The undamaged copies verify clean: test_gc_dry_run_then_gc, test_both_tiers_*.)
    flip_byte(tiers, tiers.shard(3, 1))  # bit rot in rank 1's shard
    tiers.write(tiers.shard(6, 0), tiers.read(tiers.shard(6, 0))[:1000])  # truncated
    tiers.write(tiers.manifest(9), b"{ not json")  # garbage manifest
    tiers.delete(tiers.marker(12, "n2"))  # a domain's marker (locally: its manifest) is gone

    r = tiers.rslurm("verify", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert not doc["ok"]
    faults = {s: [f for rep in doc["reports"] if rep["step"] == s for f in rep["faults"]] for s in STEPS}
    assert faults[3] and {(f["where"], f["rank"], f["kind"]) for f in faults[3]} == {
        (tiers.shown(tiers.shard(3, 1)), 1, "corrupt")}, faults[3]
    assert [(f["where"], f["rank"], f["kind"]) for f in faults[6]] == [(tiers.shown(tiers.shard(6, 0)), 0, "corrupt")]
    assert "1000" in faults[6][0]["problem"], faults[6]
    assert [f["where"] for f in faults[9]] == [tiers.shown(tiers.manifest(9))] and "JSON" in faults[9][0]["problem"]
    assert [(f["where"], f["kind"]) for f in faults[12]] == [(tiers.shown(tiers.marker(12, "n2")), "missing")]

    one = tiers.rslurm("verify", "3")
    assert one.returncode == 1 and "CORRUPT" in one.stdout, one.stdout + one.stderr
    assert f"{tiers.shown(tiers.shard(3, 1))} (rank 1): " in one.stdout, one.stdout

    # ls lists the damaged steps with their state and why, and does not fail on them.
    rows = {r["step"]: r for r in ok_json(tiers.rslurm("ls", "--json"))["steps"]}
    if tiers.kind == "local":
        assert rows[9]["local"]["state"] == "invalid" and "JSON" in rows[9]["local"]["why"]
        assert rows[12]["local"]["state"] == "invalid"
        assert f"{tiers.shown(tiers.marker(12, 'n2'))}: missing" in rows[12]["local"]["why"]
    else:
        assert rows[9]["durable"]["state"] == "invalid" and "JSON" in rows[9]["durable"]["why"]
        assert rows[12]["durable"]["state"] == "durable"  # committed; its missing marker is verify's finding
    assert rows[3]["reason"] == "interval"

    # Exporting a damaged step fails, names the shard, and leaves nothing behind.
    out = tmp_path / "exports"
    out.mkdir()
    bad = tiers.rslurm("export", "3", "--format", "torch", str(out / "s3.pt"))
    assert bad.returncode == 1 and tiers.shown(tiers.shard(3, 1)) in bad.stderr, bad.stderr
    bad = tiers.rslurm("export", "9", "--format", "torch", str(out / "s9.pt"))
    assert bad.returncode == 1 and tiers.shown(tiers.manifest(9)) in bad.stderr, bad.stderr
    if tiers.kind == "local":
        bad = tiers.rslurm("show", "9")
        assert bad.returncode == 1 and tiers.shown(tiers.manifest(9)) in bad.stderr, bad.stderr
    if tiers.kind == "s3":  # a DCP export downloads each shard into its temp directory, checked on arrival
        bad = tiers.rslurm("export", "6", "--format", "dcp", str(out / "s6"))
        assert bad.returncode == 1 and tiers.shown(tiers.shard(6, 0)) in bad.stderr, bad.stderr
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------------------------------- export
def test_export_matches_the_training_state(tiers: Tiers, trained: Path, tmp_path: Path) -> None:
    ref = [reference(trained, r) for r in range(2)]
    out = tmp_path / "state.pt"
    r = tiers.rslurm("export", "12", "--format", "torch", str(out))
    assert r.returncode == 0, r.stderr
    assert f"from the {'local' if tiers.kind == 'local' else 'durable'} tier" in r.stdout
    sd = torch.load(out, weights_only=True)
    assert set(sd) == {"model", "optimizer", "scheduler", "scaler", "sampler", "progress", "_rslurm_rng", "_rslurm_ddp",
                       "_rslurm_optim_params", "_rslurm_step"}
    assert sd["_rslurm_step"] == 12
    assert_same(sd["model"], ref[0]["model"], "model")
    # The optimizer's per-parameter state is keyed by index, as Optimizer.state_dict() gives it ...
    assert_same(sd["optimizer"]["state"], ref[0]["optimizer"]["state"], "optim")
    assert_same(sd["optimizer"]["param_groups"], ref[0]["optimizer"]["param_groups"], "param_groups")
    # ... so a fresh optimizer reloads its moments from the export (string keys: accepted, moments dropped)
    model, opt, *_ = build_toy(ref[0]["model"]["0.weight"].shape[0], 0, 0)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    assert_same({i: opt.state[p] for i, p in enumerate(model.parameters())}, ref[0]["optimizer"]["state"], "reloaded")
    assert_same(sd["scheduler"], ref[0]["scheduler"], "scheduler")
    assert_same(sd["scaler"], ref[0]["scaler"], "scaler")
    assert sd["progress"] == ref[0]["progress"] and sd["sampler"]["consumed"] == 192
    for rank in range(2):  # every rank's RNG, from both nodes' shards
        assert torch.equal(sd["_rslurm_rng"][f"rank{rank}"]["torch_cpu"], ref[rank]["rng"]), rank

    # safetensors: the model's weights alone, under the names the module has, for other tools. Once: a tier
    # changes only how the shards are read, which the torch and dcp exports check on every tier.
    if tiers.kind == "local":
        st = tmp_path / "model.safetensors"
        doc = ok_json(tiers.rslurm("export", "12", "--format", "safetensors", str(st), "--json"))
        assert (doc["format"], doc["keys"]) == ("safetensors", ["model"]), doc
        fresh, *_ = build_toy(ref[0]["model"]["0.weight"].shape[0], 1, 0)
        fresh.load_state_dict(load_file(st))  # strict: every name and shape matches
        assert_same(fresh.state_dict(), ref[0]["model"], "safetensors")
        with safe_open(st, "pt") as f:
            assert f.metadata() == {"format": "pt", "rslurm_run_id": RUN, "rslurm_step": "12", "rslurm_keys": "model"}
        both = tmp_path / "both.safetensors"
        assert tiers.rslurm("export", "12", "--format", "safetensors", "--only", "model", "--only", "scaler",
                            str(both)).returncode == 2  # the scaler's state is not only tensors: refused, nothing written
        assert not both.exists()

    d = tmp_path / "dcp"
    doc = ok_json(tiers.rslurm("export", "12", "--format", "dcp", str(d), "--json"))
    assert (doc["out"], doc["format"], doc["step"]) == (str(d), "dcp", 12)
    assert sorted(p.name for p in d.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    target: dict[str, Any] = {
        "model": {k: torch.zeros_like(v) for k, v in ref[0]["model"].items()},
        "optimizer": {"state": {k: {n: torch.zeros_like(t) for n, t in st.items()}
                                for k, st in ref[0]["optimizer"]["state"].items()}},
        "progress": {"samples_seen": 0},
        "_rslurm_rng": {"rank1": {"torch_cpu": torch.zeros_like(ref[1]["rng"])}},
    }
    dcp.load(target, checkpoint_id=str(d))  # plain DCP, no process group, no resilient_slurm
    assert_same(target["model"], ref[0]["model"], "dcp model")
    assert_same(target["optimizer"]["state"], ref[0]["optimizer"]["state"], "dcp optimizer")
    assert target["progress"] == ref[0]["progress"]
    assert torch.equal(target["_rslurm_rng"]["rank1"]["torch_cpu"], ref[1]["rng"])

    # DCP's own converter (which unpickles without restriction, so rslurm does not use it) agrees, but for
    # the optimizer's string keys and the step.
    dcp_to_torch_save(d, tmp_path / "by_dcp.pt")
    by_dcp = torch.load(tmp_path / "by_dcp.pt", weights_only=True)
    by_dcp["optimizer"]["state"] = {int(k): v for k, v in by_dcp["optimizer"]["state"].items()}
    assert_same(by_dcp, {k: v for k, v in sd.items() if k != "_rslurm_step"}, "dcp_to_torch_save")

    again = tiers.rslurm("export", "12", "--format", "dcp", str(d))
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr



def test_show_never_opens_a_shard_that_is_a_fifo_or_a_link(tiers: Tiers, tmp_path: Path) -> None:
    """``show`` reads the data position's values from the shard files: a FIFO there hung it for good, and a link was
    followed out of the tier. Neither is opened now (``verify`` names them)."""
    if tiers.kind == "s3":
        return  # an object store holds no FIFO or link
    path = tiers._path(tiers.shard(12, 0))
    outside = tmp_path / "outside.distcp"  # the same bytes, out of the tier
    shutil.copyfile(path, outside)
    assert ok_json(tiers.rslurm("show", "12", "--json"))["data_position"][0]["values"], "no value shown to begin with"
    path.unlink()
    os.mkfifo(path)
    r = tiers.rslurm("show", "12", "--json")  # a hang ends in subprocess's timeout
    assert ok_json(r)["step"] == 12
    path.unlink()
    path.symlink_to(outside)
    doc = ok_json(tiers.rslurm("show", "12", "--json"))
    assert all(p["values"] == {} for p in doc["data_position"]), doc["data_position"]


def test_a_typed_run_id_is_looked_for_in_the_tier_and_a_prefix_of_a_run_is_not_that_run(tiers: Tiers) -> None:
    """``--run-id`` typed on the command line must name a run the tier has (inventory.Catalog.has_run): on S3 by
    listing ``<run>/`` (its step prefixes, or an object directly under it), so neither a prefix of a run's name nor
    a longer name passes for it."""
    listed = ok_json(tiers.rslurm("ls", "--json", "--run-id", RUN))
    assert sorted(r["step"] for r in listed["steps"]) == list(STEPS)
    for typo in (RUN[:-1], RUN + "2"):
        r = tiers.rslurm("ls", "--run-id", typo)
        assert r.returncode == 2 and f"no run {typo!r}" in r.stderr and f"the runs there: {RUN}" in r.stderr, (
            typo, r.returncode, r.stderr)
    if tiers.kind == "local":
        return
    # A run the durable tier has only an object of, directly under its name (no step yet): it is there.
    if tiers.lustre is not None:
        (tiers.lustre / "early").mkdir()
    tiers.write("early/notes.txt", b"x")
    r = tiers.rslurm("ls", "--json", "--run-id", "early")
    assert ok_json(r)["steps"] == [], r.stdout

# --------------------------------------------------------------------------------------------- gc
def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


def test_gc_dry_run_then_gc(tiers: Tiers) -> None:
    day = 86400.0
    if tiers.kind == "local":
        for node in NODES:  # a save killed two days ago, and one being written now
            dead = tiers.nvme / node / RUN / f"{sdir(13)}.tmp-dead"
            dead.mkdir()
            (dead / "__0_0.distcp").write_bytes(b"x" * 100)
            _age(dead, 2 * day)
            live = tiers.nvme / node / RUN / f"{sdir(14)}.tmp-live"
            live.mkdir()
            (live / "__0_0.distcp").write_bytes(b"y")
    elif tiers.kind == "posix":
        assert tiers.lustre is not None
        leftover = tiers.lustre / RUN / sdir(12) / "__0_0.distcp.tmp-rslurm-dead"  # a killed daemon's copy
        leftover.write_bytes(b"z" * 100)
        _age(leftover, 2 * day)
        fresh = tiers.lustre / RUN / sdir(12) / "__1_0.distcp.tmp-rslurm-live"
        fresh.write_bytes(b"z")
    before = ok_json(tiers.rslurm("ls", "--json"))

    plan = ok_json(tiers.rslurm("gc", "--dry-run", "--keep-last", "2", "--json"))
    assert plan["dry_run"] and plan["keep_last"] == 2 and plan["ok"]
    acts = [(a["tier"], a["kind"], a["step"], a["where"]) for a in plan["actions"]]
    if tiers.kind == "local":
        expected = {("local", "step", s, str(tiers.nvme / n / RUN / sdir(s))) for s in (3, 6) for n in NODES}
        expected |= {("local", "stale_temp", 13, str(tiers.nvme / n / RUN / f"{sdir(13)}.tmp-dead")) for n in NODES}
    else:
        url = tiers.env["RSLURM_DURABLE"]
        expected = {("durable", "step", s, f"{url}/{RUN}/{sdir(s)}") for s in (3, 6)}
        if tiers.kind == "posix":
            expected.add(("durable", "incomplete_upload", 12, f"{url}/{RUN}/{sdir(12)}/__0_0.distcp"))
    assert set(acts) == expected and len(acts) == len(expected), acts
    assert all(a["state"] == "planned" and a["why"] for a in plan["actions"])
    after = ok_json(tiers.rslurm("ls", "--json"))  # nothing changed
    assert [(r["step"], r["local"], r["durable"]) for r in after["steps"]] == [
        (r["step"], r["local"], r["durable"]) for r in before["steps"]]
    for s in (3, 6):
        assert tiers.exists(tiers.shard(s, 0)) and tiers.exists(tiers.manifest(s))

    r = tiers.rslurm("gc", "--keep-last", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deleted" in r.stdout and "freed" in r.stdout
    rows = ok_json(tiers.rslurm("ls", "--json"))["steps"]
    assert [x["step"] for x in rows if x["reason"]] == [9, 12]
    for s in (3, 6):
        assert not tiers.exists(tiers.manifest(s)) and not tiers.exists(tiers.shard(s, 1))
    for s in (9, 12):
        assert tiers.exists(tiers.shard(s, 0)) and tiers.exists(tiers.manifest(s))
    if tiers.kind == "local":
        for node in NODES:
            assert not (tiers.nvme / node / RUN / f"{sdir(13)}.tmp-dead").exists()
            assert (tiers.nvme / node / RUN / f"{sdir(14)}.tmp-live").exists()
        assert [x["local"]["state"] for x in rows if x["step"] == 14] == ["in_progress"]
    if tiers.kind == "posix":
        assert not leftover.exists() and fresh.exists()
    clean = ok_json(tiers.rslurm("verify", "--json"))
    assert clean["ok"] and clean["faults"] == 0
    per_copy = 2 if tiers.kind == "local" else 1  # each domain's local copy, or the durable step
    assert sorted(r["step"] for r in clean["reports"] if r["files_checked"]) == sorted(
        s for s in (9, 12) for _ in range(per_copy))
    again = ok_json(tiers.rslurm("gc", "--keep-last", "2", "--json"))
    assert again["actions"] == []

    if tiers.kind == "s3":  # an upload a killed daemon left: listed by the dry run, then aborted
        assert tiers.server is not None
        key = f"{PREFIX}/{RUN}/{sdir(12)}/__0_0.distcp"
        tiers.server.client().create_multipart_upload(Bucket=tiers.bucket, Key=key)
        # (moto dates every upload 2010-11-10, so it is stale for any --stale-after; the age rule is the
        # POSIX case's fresh temp file.)
        plan = ok_json(tiers.rslurm("gc", "--dry-run", "--json"))
        assert [(a["kind"], a["where"], a["state"]) for a in plan["actions"]] == [
            ("incomplete_upload", f"s3://{tiers.bucket}/{key}", "planned")]
        assert len(tiers.server.uploads(tiers.bucket)) == 1
        done = ok_json(tiers.rslurm("gc", "--json"))
        assert [a["state"] for a in done["actions"]] == ["deleted"]
        assert tiers.server.uploads(tiers.bucket) == []


# --------------------------------------------------------------------------------------------- both tiers
def test_both_tiers_partial_steps_and_the_undrained_step(trained: Path, posix_pristine: Path, tmp_path: Path) -> None:
    t = Tiers("posix", tmp_path / "nvme", lustre=tmp_path / "lustre")
    shutil.copytree(trained / "nvme", t.nvme)
    shutil.copytree(posix_pristine, tmp_path / "lustre")
    rows = {r["step"]: r for r in ok_json(t.rslurm("ls", "--json"))["steps"]}
    assert {(r["local"]["state"], r["durable"]["state"]) for r in rows.values()} == {("complete", "durable")}

    shutil.rmtree(t.nvme / "n2" / RUN / sdir(12))  # n2's copy of step 12 is gone (n2 lost its disk)
    (t.nvme / "n1" / RUN / f"{sdir(15)}.tmp-abc").mkdir()  # a save in progress
    doc = ok_json(t.rslurm("ls", "--json"))
    rows = {r["step"]: r for r in doc["steps"]}
    assert rows[12]["local"]["state"] == "partial" and rows[12]["local"]["missing_domains"] == ["n2"]
    assert rows[15]["local"]["state"] == "in_progress" and rows[15]["durable"]["state"] == "absent"
    table = t.rslurm("ls")
    assert "1/2 domains" in table.stdout and "in progress" in table.stdout, table.stdout

    r = t.rslurm("export", "12", "--tier", "local", "--format", "torch", str(tmp_path / "x.pt"))
    assert r.returncode == 2 and "not complete in the local tier" in r.stderr and "n2" in r.stderr, r.stderr
    out = tmp_path / "model.pt"
    doc = ok_json(t.rslurm("export", "12", "--format", "torch", "--only", "model", str(out), "--json"))
    assert doc["tier"] == "durable" and doc["keys"] == ["model"]  # the local tier lacks n2: the durable copy
    assert_same(torch.load(out, weights_only=True), {"model": reference(trained, 0)["model"]})
    again = t.rslurm("export", "12", "--format", "torch", str(out), "--force")
    assert again.returncode == 0, again.stderr
    assert "_rslurm_rng" in torch.load(out, weights_only=True)

    both = ok_json(t.rslurm("verify", "12", "--tier", "all", "--json"))
    assert [(x["tier"], x["domain"], x["ok"]) for x in both["reports"]] == [("local", "n1", True),
                                                                          ("durable", None, True)]
    assert "n2" in both["reports"][0]["notes"][0]
    assert ok_json(t.rslurm("show", "12", "--json"))["tier"] == "durable"  # (complete steps: local, test_ls_and_show)

    # Step 9 is committed locally but not durable (its durable manifest is gone): gc keeps it, the newest
    # such step, although keep_last=1 would not; the durable tier keeps its uncommitted step 9 (recent).
    (t.lustre / RUN / sdir(9) / "manifest.json").unlink()  # type: ignore[operator]
    # Both domains' manifests and commit markers are there, the step manifest is not: the last node stopped
    # between its marker and the commit. `ls` says so, not "2/2 markers" as if the drain were done.
    d9 = {r["step"]: r for r in ok_json(t.rslurm("ls", "--json"))["steps"]}[9]["durable"]
    assert (d9["state"], d9["markers"], d9["committed"]) == ("partial", list(NODES), list(NODES)), d9
    assert "2/2 domain manifests (n1, n2), 2/2 commit markers of save" in d9["why"], d9
    assert "partial 2/2 (2 committed)" in t.rslurm("ls").stdout
    plan = ok_json(t.rslurm("gc", "--keep-last", "1", "--dry-run", "--json"))
    acts = {(a["tier"], a["kind"], a["step"], a["where"]) for a in plan["actions"]}
    assert acts == {("local", "step", s, str(t.nvme / n / RUN / sdir(s))) for s in (3, 6) for n in NODES} | {
        ("durable", "step", s, f"{t.lustre}/{RUN}/{sdir(s)}") for s in (3, 6)}, acts
    ok_json(t.rslurm("gc", "--keep-last", "1", "--json"))
    assert sorted(p.name for p in (t.nvme / "n1" / RUN).glob("step_*")) == [sdir(9), sdir(12), f"{sdir(15)}.tmp-abc"]
    assert sorted(p.name for p in (t.lustre / RUN).glob("step_*")) == [sdir(9), sdir(12)]  # type: ignore[operator]


def test_ls_lists_the_local_tier_when_the_durable_tier_is_unreachable(trained: Path) -> None:
    t = Tiers("local", trained / "nvme")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = t.rslurm("ls", "--json", "--durable", "s3://bucket/ckpt", "--s3-endpoint-url", dead, "--s3-max-attempts", "1",
                 **s3_support.FAKE_ENV)
    assert r.returncode == 2, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["errors"] and all(dead in e for e in doc["errors"]), doc["errors"]
    assert [(x["step"], x["local"]["state"], x["durable"]["state"]) for x in doc["steps"]] == [
        (s, "complete", "unknown") for s in STEPS]


def test_verify_shows_progress_on_a_terminal_and_not_with_json(trained: Path, tmp_path: Path) -> None:
    t = Tiers("local", trained / "nvme")

    def stderr_on_a_tty(*args: str) -> tuple[int, str, bytes]:
        master, slave = pty.openpty()
        p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", *args], stdout=subprocess.PIPE,
                             stderr=slave, env=clean_env(t.env))
        os.close(slave)
        seen = b""
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        os.close(master)
        out = p.stdout.read().decode() if p.stdout else ""
        return p.wait(timeout=60), out, seen

    code, out, tty = stderr_on_a_tty("verify", "12")
    assert code == 0 and "OK" in out
    assert b"verify run toy step 12 local n1" in tty and b"KiB" in tty, tty[:500]
    code, out, tty = stderr_on_a_tty("verify", "12", "--json")
    assert code == 0 and json.loads(out)["ok"] and b"verify run" not in tty
