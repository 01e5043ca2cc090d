"""Peer replicas (``<root>/<run>/replicas/<domain>/step_X/``: a partner domain's committed steps copied to
this node) in the daemon's eviction, ``rslurm ls`` and ``rslurm status``.

Real components: own steps committed by the real engine in process (node ``n1``); replicas are real
committed steps of another domain (the engine run as ``n2``/``n3`` into a scratch root), copied where the
peer writer puts them. The daemon runs in process (with a simulated disk: ``os.statvfs`` of the local root
reports a fixed capacity less the bytes really under it, so what is evicted decides what is free) and as a
real ``rslurm daemon --once`` process; ``ls`` and ``status`` are real ``rslurm`` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_jsonl, run_rslurm, sdir

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.policy import RetentionPolicy
from resilient_slurm.daemon import service
from resilient_slurm.daemon.service import Daemon
from resilient_slurm.storage.posix import PosixTier
from resilient_slurm.telemetry import EVENTS_FILE

MiB = 1 << 20
RUN, OTHER = "r", "q"  # this node (n1) has own steps of RUN; of OTHER it holds replicas only

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="flock and statvfs as on Linux"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


# --------------------------------------------------------------------------------------------- helpers
def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed, not counted)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for n in files:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink():
                total += p.lstat().st_size
    return total


def save(root: Path, run: str, steps: list[int], node: str, nbytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit ``steps`` of ``run`` in ``root`` as storage domain ``node``, with the real engine."""
    monkeypatch.setenv("RSLURM_NODE_NAME", node)
    with Checkpointer(local_dir=str(root), run_id=run, keep_last=10) as ck:
        for s in steps:
            g = torch.Generator().manual_seed(1000 + s)
            ck.save(s, {"w": torch.randn(nbytes // 4, generator=g), "step": s})
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")


def replica(root: Path, run: str, domain: str, step: int, nbytes: int, scratch: Path,
            monkeypatch: pytest.MonkeyPatch) -> Path:
    """A committed replica of ``domain``'s ``step`` of ``run`` in this node's ``root`` (the domain's real
    step, copied where the peer writer commits it)."""
    src = scratch / domain
    save(src, run, [step], domain, nbytes, monkeypatch)
    dst = root / run / "replicas" / domain / sdir(step)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / run / sdir(step), dst)
    return dst


def entries(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.exists() else set()


def own_steps(root: Path, run: str = RUN) -> set[int]:
    return {int(p.name[5:]) for p in (root / run).glob("step_*") if ".tmp-" not in p.name}


def block_durable(dur: Path, run: str, steps: list[int]) -> None:
    """The durable tier cannot take these steps (a file sits where each directory goes): they stay undrained."""
    (dur / run).mkdir(parents=True, exist_ok=True)
    for s in steps:
        (dur / run / sdir(s)).write_text("not a directory")


def fake_disk(monkeypatch: pytest.MonkeyPatch, root: Path, capacity: int) -> Callable[[], int]:
    """``os.statvfs(root)`` reports ``capacity`` bytes less those really under ``root`` (every other path:
    the real filesystem). Returns the free bytes it reports now."""
    real = os.statvfs

    def free() -> int:
        return capacity - tree_size(root)

    def statvfs(path: Any) -> os.statvfs_result:
        if os.path.realpath(os.fspath(path)) != os.path.realpath(root):
            return real(path)
        n = free()
        return os.statvfs_result((4096, 1, capacity, n, n, 10**6, 10**6, 10**6, 0, 255))

    monkeypatch.setattr(service.os, "statvfs", statvfs)
    return free


def evicted_events(root: Path, run: str) -> list[dict[str, Any]]:
    p = root / run / EVENTS_FILE
    return [r for r in read_jsonl(p) if r.get("event") == "evicted"] if p.exists() else []


def rslurm(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_MIN_FREE": "1M", **(env or {})},
                      timeout=180)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This node's root: own steps 1, 2 of RUN (n1, undrainable: the durable tier refuses them); a replica
    of OTHER's step 9 of domain n3 (saved first: the oldest), then one of RUN's step 3 of domain n2."""
    monkeypatch.setenv("RSLURM_FREE_SPACE_MARGIN", "0")
    root, dur, scratch = tmp_path / "nvme", tmp_path / "lustre", tmp_path / "partners"
    q9 = replica(root, OTHER, "n3", 9, 2 * MiB, scratch, monkeypatch)
    r3 = replica(root, RUN, "n2", 3, 2 * MiB, scratch, monkeypatch)
    save(root, RUN, [1, 2], "n1", 2 * MiB, monkeypatch)
    block_durable(dur, RUN, [1, 2])
    return {"root": root, "dur": dur, "q9": q9, "r3": r3, "q9_bytes": tree_size(q9), "r3_bytes": tree_size(r3),
            "own1_bytes": tree_size(root / RUN / sdir(1))}


def one_pass(root: Path, dur: Path, min_free: int) -> tuple[Daemon, bool]:
    """One pass of a daemon of node n1 (scan, drain, retention, eviction, status); and whether a step failed."""
    d = Daemon(str(root), PosixTier(str(dur)), node="n1", retention=RetentionPolicy(10), min_free=str(min_free),
               poll_interval=0.1, metrics_textfile=None)
    d.acquire()
    try:
        return d, d.run_pass()[1]
    finally:
        d.release()


# ------------------------------------------------------------------------------------------- eviction
def test_eviction_takes_replicas_first_oldest_first_and_leaves_own_undrained_steps(
        layout: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    root, dur = layout["root"], layout["dur"]
    free = fake_disk(monkeypatch, root, capacity=64 * MiB)
    # Both replicas must go, and they are enough (the margin covers the events the pass writes).
    need = free() + layout["q9_bytes"] + layout["r3_bytes"] - 64 * 1024
    d, failed = one_pass(root, dur, need)
    assert failed  # steps 1 and 2 could not be drained: not durable
    assert free() >= need
    assert own_steps(root) == {1, 2}, "an own step was evicted though the replicas were enough"
    assert entries(root / RUN / "replicas" / "n2") == set() and entries(root / OTHER / "replicas" / "n3") == set()
    q, r = evicted_events(root, OTHER), evicted_events(root, RUN)
    assert [(e["step"], e["replica_of"], e["bytes"]) for e in q] == [(9, "n3", layout["q9_bytes"])], q
    assert [(e["step"], e["replica_of"], e["bytes"]) for e in r] == [(3, "n2", layout["r3_bytes"])], r
    assert q[0]["t"] <= r[0]["t"]  # the older save first, across runs (step 9 of OTHER before step 3 of RUN)
    assert r[0]["durable"] is False and q[0]["durable"] is None  # OTHER's durable steps were not listed
    assert d.counters["rslurm_local_evicted_steps_total"] == 2


def test_eviction_goes_on_to_own_steps_only_after_every_replica(layout: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root, dur = layout["root"], layout["dur"]
    free = fake_disk(monkeypatch, root, capacity=64 * MiB)
    need = free() + layout["q9_bytes"] + layout["r3_bytes"] + layout["own1_bytes"] // 2
    one_pass(root, dur, need)
    assert own_steps(root) == {2}  # the older undrained step went, after the replicas; never the newest
    r = evicted_events(root, RUN)
    assert [(e["step"], e["replica_of"]) for e in r] == [(3, "n2"), (1, None)], r
    assert evicted_events(root, OTHER)[0]["t"] <= r[0]["t"]
    assert {"step", "durable", "bytes", "free_bytes", "replica_of"} <= set(r[1]), r[1]


def test_no_eviction_above_the_watermark_keeps_replicas(layout: dict[str, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root, dur = layout["root"], layout["dur"]
    free = fake_disk(monkeypatch, root, capacity=64 * MiB)
    one_pass(root, dur, free() - MiB)
    assert layout["q9"].is_dir() and layout["r3"].is_dir() and own_steps(root) == {1, 2}
    assert evicted_events(root, RUN) == evicted_events(root, OTHER) == []


@pytest.mark.proc
def test_daemon_process_evicts_replicas_before_own_steps(layout: dict[str, Any]) -> None:
    """A real ``rslurm daemon --once`` asked for more free space than the filesystem has: every replica goes
    first, then the older undrained own step; the newest undrained one stays."""
    root, dur = layout["root"], layout["dur"]
    st = os.statvfs(root)
    impossible = str(2 * st.f_blocks * st.f_frsize)
    r = rslurm("daemon", "--local-dir", str(root), "--durable", str(dur), "--once", "--local-min-free", impossible)
    assert r.returncode == 1, r.stderr  # steps 1 and 2 could not be drained
    lines = [ln.split("evicted run ")[1] for ln in r.stderr.splitlines() if "evicted run " in ln]
    assert [(ln.split()[0], int(ln.split()[2]), "replica of domain" in ln) for ln in lines] == [
        (OTHER, 9, True), (RUN, 3, True), (RUN, 1, False)], r.stderr
    assert own_steps(root) == {2}
    assert entries(root / RUN / "replicas" / "n2") == set() and entries(root / OTHER / "replicas" / "n3") == set()


def test_eviction_never_follows_replica_links_or_files(layout: dict[str, Any], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    root, dur = layout["root"], layout["dur"]
    outside = tmp_path / "outside"
    # a domain directory that is a link, a file named like a domain, a replica step that is a link, and a
    # run whose replicas directory is a link: each points at a real committed step outside the root
    for name in ("dom", "step", "top/n4"):
        shutil.copytree(layout["r3"], outside / name / sdir(3))
    (root / RUN / "replicas" / "n9").symlink_to(outside / "dom")
    (root / RUN / "replicas" / "n8").write_text("not a domain directory")
    (root / RUN / "replicas" / "n2" / sdir(5)).symlink_to(outside / "step" / sdir(3))
    (root / "linked").mkdir()
    (root / "linked" / "replicas").symlink_to(outside / "top")
    before = {p: tree_size(p) for p in (outside / "dom", outside / "step", outside / "top")}
    free = fake_disk(monkeypatch, root, capacity=64 * MiB)
    one_pass(root, dur, 10 * free() + 1)  # never enough: everything evictable goes
    assert {p: tree_size(p) for p in before} == before, "eviction deleted data through a link"
    assert (root / RUN / "replicas" / "n9").is_symlink() and (root / RUN / "replicas" / "n8").is_file()
    assert entries(root / RUN / "replicas" / "n2") == {sdir(5)}  # the real replica went, the link stayed
    assert not layout["q9"].exists() and own_steps(root) == {2}
    assert evicted_events(root, "linked") == []


# ------------------------------------------------------------------------------------ ls and status
@pytest.mark.proc
def test_ls_shows_replicas_apart_from_own_steps(layout: dict[str, Any], tmp_path: Path) -> None:
    root = layout["root"]
    (root / RUN / "replicas" / "n2" / (sdir(4) + ".tmp-replica-abcd1234")).mkdir()
    doc = json.loads(ok(rslurm("ls", "--json", "--tier", "local", "--local-dir", str(root))))
    assert [(s["run_id"], s["step"]) for s in doc["steps"]] == [(RUN, 1), (RUN, 2)], doc["steps"]
    got = {(rs["run_id"], rs["domain"]): rs for rs in doc["replicas"]}
    assert set(got) == {(OTHER, "n3"), (RUN, "n2")}, doc["replicas"]
    r = got[(RUN, "n2")]
    assert [(s["step"], s["bytes"], s["problem"]) for s in r["steps"]] == [(3, layout["r3_bytes"], None)]
    assert r["bytes"] == layout["r3_bytes"] and r["steps"][0]["path"] == str(layout["r3"])
    assert r["steps"][0]["created_at"] is not None and r["steps"][0]["age_s"] >= 0
    assert [t["step"] for t in r["receiving"]] == [4]
    q = got[(OTHER, "n3")]
    assert [(s["step"], s["bytes"]) for s in q["steps"]] == [(9, layout["q9_bytes"])] and q["receiving"] == []
    assert doc["errors"] == []

    # one run only
    doc = json.loads(ok(rslurm("ls", "--json", "--tier", "local", "--local-dir", str(root), "--run-id", OTHER)))
    assert doc["steps"] == [] and [(rs["run_id"], rs["domain"]) for rs in doc["replicas"]] == [(OTHER, "n3")]

    text = ok(rslurm("ls", "--tier", "local", "--local-dir", str(root)))
    head, _, tail = text.partition("replicas held here")
    assert tail, text
    own_rows = [ln.split() for ln in head.splitlines() if ln.split()[:1] == [RUN]]
    assert [int(r[1]) for r in own_rows] == [1, 2], text  # no replica step among the own steps
    rows = [ln.split() for ln in tail.splitlines()[1:] if ln.split()[:1] in ([RUN], [OTHER])]
    assert [r[:3] for r in rows] == [[OTHER, "n3", "9"], [RUN, "n2", "3"], [RUN, "n2", "4"]], text
    assert "MiB" in rows[0][4] and "being received" in " ".join(rows[2]), text


@pytest.mark.proc
def test_ls_without_replicas_prints_no_replica_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "nvme"
    save(root, RUN, [1], "n1", MiB, monkeypatch)
    (root / RUN / "replicas").mkdir()  # empty: nothing held
    text = ok(rslurm("ls", "--tier", "local", "--local-dir", str(root)))
    assert "replicas held here" not in text, text
    doc = json.loads(ok(rslurm("ls", "--json", "--tier", "local", "--local-dir", str(root))))
    assert doc["replicas"] == [] and [s["step"] for s in doc["steps"]] == [1]


@pytest.mark.proc
def test_status_shows_replicas_held_and_being_received(layout: dict[str, Any]) -> None:
    root = layout["root"]
    (root / RUN / "replicas" / "n2" / (sdir(4) + ".tmp-replica-abcd1234")).mkdir()
    (root / RUN / "replicas" / "n2" / (sdir(2) + ".tmp-evict-0000")).mkdir()  # a deletion, not a receipt
    (root / RUN / "replicas" / "n5" / (sdir(6) + ".tmp-replica-ffff0000")).mkdir(parents=True)  # only receiving
    doc = json.loads(ok(rslurm("status", "--json", "--local-dir", str(root))))
    assert doc["replicas"] == {
        OTHER: [{"domain": "n3", "steps": [9], "bytes": layout["q9_bytes"], "receiving": []}],
        RUN: [{"domain": "n2", "steps": [3], "bytes": layout["r3_bytes"], "receiving": [4]},
              {"domain": "n5", "steps": [], "bytes": 0, "receiving": [6]}],
    }, doc["replicas"]
    assert sorted(r["step"] for r in doc["steps"] if r["run_id"] == RUN) == [1, 2], doc["steps"]
    assert not [r for r in doc["steps"] if r["run_id"] == OTHER], doc["steps"]
    text = ok(rslurm("status", "--local-dir", str(root)))
    lines = {ln.split(":")[0].split()[-1]: ln for ln in text.splitlines() if ln.startswith("replicas ")}
    assert set(lines) == {OTHER, RUN}, text
    assert "n2's step 3 (" in lines[RUN] and "receiving step 4" in lines[RUN], lines[RUN]
    assert "receiving n5's step 6" in lines[RUN], lines[RUN]
    assert "n3's step 9 (" in lines[OTHER] and "receiving" not in lines[OTHER], lines[OTHER]


@pytest.mark.proc
def test_ls_and_status_ignore_replica_links_and_files(layout: dict[str, Any], tmp_path: Path) -> None:
    root = layout["root"]
    outside = tmp_path / "outside"
    for name in ("dom", "step", "top/n4"):
        shutil.copytree(layout["r3"], outside / name / sdir(3))
    (root / RUN / "replicas" / "n9").symlink_to(outside / "dom")
    (root / RUN / "replicas" / "n8").write_text("not a domain directory")
    (root / RUN / "replicas" / ".hidden").mkdir()  # not a domain name
    (root / RUN / "replicas" / "n2" / sdir(5)).symlink_to(outside / "step" / sdir(3))
    (root / "linked").mkdir()
    (root / "linked" / "replicas").symlink_to(outside / "top")
    doc = json.loads(ok(rslurm("ls", "--json", "--tier", "local", "--local-dir", str(root))))
    got = {(rs["run_id"], rs["domain"]): [s["step"] for s in rs["steps"]] for rs in doc["replicas"]}
    assert got == {(OTHER, "n3"): [9], (RUN, "n2"): [3]}, doc["replicas"]
    assert 5 not in [s["step"] for s in doc["steps"]]
    st = json.loads(ok(rslurm("status", "--json", "--local-dir", str(root))))
    assert {run: [(h["domain"], h["steps"]) for h in held] for run, held in st["replicas"].items()} == {
        OTHER: [("n3", [9])], RUN: [("n2", [3])]}, st["replicas"]
    text = ok(rslurm("status", "--local-dir", str(root)))
    assert "n9" not in text and "n8" not in text and "linked:" not in text, text
