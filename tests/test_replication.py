"""Replication is proven, domains follow directories, and a commit never lies.

Unit tests of the pieces (digests, the item table, the tracker's decisions, per-rank planning), then real
rank processes (gloo) through tests/workers/replica_worker.py: a desynchronised DDP replica named by a
``replica_mismatch`` event (or failing the save), per-rank state refused at another world size unless
ranks are mapped, storage domains by directory, and fault injection on one rank's shard.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, checkpoint_entries, clean_env, read_jsonl, run_ranks
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from resilient_slurm.checkpoint.planning import create_global_save_plan
from resilient_slurm.checkpoint.replication import (
    ItemTable,
    ReplicaTracker,
    digest_value,
    digest_vector,
    equal_from_reduced,
    mismatch_from_digests,
)
from resilient_slurm.manifest import per_rank_fqn, split_per_rank_fqn

WORKER = str(REPO / "tests" / "workers" / "replica_worker.py")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")


# --------------------------------------------------------------------------- units
def _plan(sd: dict[str, Any]) -> SavePlan:
    p = DefaultSavePlanner()
    p.set_up_planner(sd, is_coordinator=False)
    return p.create_local_plan()


def test_per_rank_keys_round_trip() -> None:
    assert split_per_rank_fqn(per_rank_fqn(3, "data.gen")) == (3, "data.gen")
    for key in ("data.gen", "_rslurm_per_rank", "_rslurm_per_rank.x.a", "_rslurm_per_rank.2", "_rslurm_rng.rank0.x"):
        assert split_per_rank_fqn(key) is None, key


def test_digests_see_bytes_dtype_and_shape() -> None:
    a = torch.arange(12, dtype=torch.float32)
    assert digest_value(a) == digest_value(a.clone()) == digest_value(a.reshape(3, 4).t().contiguous().t().reshape(-1))
    assert digest_value(a) != digest_value(a.reshape(3, 4))  # same bytes, another shape
    assert digest_value(a) != digest_value(a.view(torch.int32))  # same bytes, another dtype
    b = a.clone()
    b[7] = torch.nextafter(b[7], torch.tensor(100.0))  # one ulp
    assert digest_value(a) != digest_value(b)
    assert digest_value(torch.ones(3, dtype=torch.bfloat16)) != digest_value(torch.ones(3, dtype=torch.float16))
    assert digest_value(torch.empty(0, 4)) != digest_value(torch.empty(4, 0))
    assert digest_value(b"x") == digest_value(b"x") != digest_value(b"y")
    assert 0 <= digest_value(a) < 2**63


def test_plain_value_digests_see_types_values_and_nested_tensors() -> None:
    v = {"epoch": 3, "lr": 0.1, "tags": ["a", "b"], "w": torch.ones(2), "flag": True, "none": None}
    assert digest_value(v) == digest_value({**v, "w": torch.ones(2)})
    for other in ({**v, "epoch": 3.0}, {**v, "flag": 1}, {**v, "tags": ("a", "b")}, {**v, "lr": 0.1 + 1e-17 + 2e-17},
                  {**v, "w": torch.ones(2, dtype=torch.float64)}, {**v, "none": 0}, {**v, "tags": ["ab"]}):
        assert digest_value(other) != digest_value(v), other
    assert digest_value(-0.0) != digest_value(0.0)
    assert digest_value({1, 2}) == digest_value({1, 2})  # other types: through their serialization


def test_all_reduce_encoding_finds_unequal_items() -> None:
    items = [MetadataIndex("a"), MetadataIndex("b"), MetadataIndex("c")]
    ranks = [{items[0]: 5, items[1]: 7}, {items[0]: 5, items[1]: 8, items[2]: 1}, {items[2]: 1}]
    vecs = [digest_vector(items, r) for r in ranks]
    reduced = [max(col) for col in zip(*vecs)]  # what all_reduce(MAX) returns
    assert equal_from_reduced(reduced, 3) == [True, False, True]


def test_item_table_shared_and_proven() -> None:
    t = torch.zeros(4)
    plans = [_plan({"m": {"w": t}, "x": 1, "only0": 2}), _plan({"m": {"w": t}, "x": 1}),
             _plan({"m": {"w": t}, "x": 1})]
    table = ItemTable.build(plans, [{"m.w": None}, {"m.w": None}, {}])
    assert [i.fqn for i in table.order] == ["m.w", "x"]
    assert table.holders[table.order[0]] == (0, 1, 2)
    assert not table.proven  # rank 2 does not vouch for m.w
    table = ItemTable.build(plans, [{"m.w": None}] * 3)
    assert {i.fqn for i in table.proven} == {"m.w"} and table.nbytes[table.order[0]] == 16


def test_replicas_by_construction_are_replicas_only_within_their_group() -> None:
    """Two pipeline stages, each a DDP (or a device mesh) of two ranks, with an optimizer keyed by index:
    ``opt.state.0.exp_avg`` is held by all four ranks, but ranks 0-1 and 2-3 hold different parameters'
    moments. Written once (proven) only where one group holds every copy; otherwise digested, and then
    stored per rank, never deduplicated across the stages."""
    a, b = torch.zeros(4), torch.ones(4)
    plans = [_plan({"opt": {"m": a}}), _plan({"opt": {"m": a}}), _plan({"opt": {"m": b}}), _plan({"opt": {"m": b}})]
    stage0, stage1 = frozenset({0, 1}), frozenset({2, 3})
    table = ItemTable.build(plans, [{"opt.m": stage0}, {"opt.m": stage0}, {"opt.m": stage1}, {"opt.m": stage1}])
    assert [i.fqn for i in table.order] == ["opt.m"] and not table.proven
    tr = ReplicaTracker("off")
    sel = tr.select(table)
    assert [i.fqn for i in sel] == ["opt.m"]  # digested even with replica_check=off
    equal = equal_from_reduced(
        [max(c) for c in zip(*(digest_vector(sel, {sel[0]: digest_value(t)}) for t in (a, a, b, b)))], 1)
    newly, _ = tr.update(table, sel, equal)
    assert [i.fqn for i in newly] == ["opt.m"]
    plan = create_global_save_plan(plans, ["n1"] * 4, tr.rename())
    assert {i.index.fqn for p in plan.plans for i in p.items} == {per_rank_fqn(r, "opt.m") for r in range(4)}
    # Within one group (two ranks of stage 0 only): proven.
    assert ItemTable.build(plans[:2], [{"opt.m": stage0}] * 2).proven


def test_a_key_of_another_kind_on_some_ranks_is_stored_per_rank() -> None:
    """nanoGPT's ``best_val_loss``: a tensor on rank 0, a float elsewhere; and tensors of other ranks (not
    chunks of one tensor). DCP's planner asserts on such a key; here every rank's item goes per rank."""
    plans = [_plan({"best": torch.tensor(0.5), "t": torch.zeros(2, 3)}), _plan({"best": 1e9, "t": torch.zeros(6)}),
             _plan({"best": 1e9, "t": torch.zeros(2, 3)})]
    table = ItemTable.build(plans, [{}] * 3)
    assert {i.fqn for i in table.mixed} == {"best", "t"} and not table.order  # nothing left to digest
    assert table.mixed_kinds["best"] == {0: "a tensor () float32", 1: "a plain value", 2: "a plain value"}
    tr = ReplicaTracker()
    assert tr.select(table) == []
    plan = create_global_save_plan(plans, ["n1"] * 3, tr.rename())
    fqns = set(plan.metadata.state_dict_metadata)
    assert fqns == {per_rank_fqn(r, k) for r in range(3) for k in ("best", "t")}, fqns


def test_tracker_digests_unproven_every_save_and_rotates_through_proven() -> None:
    w = [torch.zeros(256) for _ in range(5)]  # 1 KiB each
    sd = {"m": {f"w{i}": w[i] for i in range(5)}, "cursor": 3}
    plans = [_plan(sd), _plan(sd)]
    table = ItemTable.build(plans, [dict.fromkeys((f"m.w{i}" for i in range(5)), None)] * 2)
    tr = ReplicaTracker("warn", check_bytes=2048)
    seen: set[str] = set()
    for _ in range(3):
        sel = tr.select(table)
        assert "cursor" in {i.fqn for i in sel}  # not proven: every save
        seen |= {i.fqn for i in sel if i in table.proven}
        assert len([i for i in sel if i in table.proven]) <= 2  # 2 KiB per save
        tr.update(table, sel, [True] * len(sel))
    assert seen == {f"m.w{i}" for i in range(5)}
    # The cursor differs: stored per rank from now on, and no longer digested.
    sel = tr.select(table)
    newly, mismatched = tr.update(table, sel, [i.fqn != "cursor" for i in sel])
    assert [i.fqn for i in newly] == ["cursor"] and not mismatched
    assert "cursor" not in {i.fqn for i in tr.select(table)}
    assert {i.fqn for i in tr.rename()} == {"cursor"}
    # A proven item that differs is a mismatch, digested at every save until it is equal again.
    tr2 = ReplicaTracker("warn", check_bytes=1 << 20)
    sel = tr2.select(table)
    newly, mismatched = tr2.update(table, sel, [i.fqn != "m.w3" for i in sel])
    assert [i.fqn for i in mismatched] == ["m.w3"] and [i.fqn for i in newly] == []
    tr2.check_bytes = 0
    assert "m.w3" in {i.fqn for i in tr2.select(table)}
    assert {i.fqn for i in tr2.rename(mismatched)} == {"m.w3"}
    off = ReplicaTracker("off")
    assert {i.fqn for i in off.select(table)} == {"cursor"}
    with pytest.raises(ValueError, match="replica_check"):
        ReplicaTracker("loud")


def test_mismatch_names_the_minority_and_the_majority() -> None:
    m = mismatch_from_digests(MetadataIndex("model.w"), {0: 1, 1: 1, 2: 9, 3: 1})
    assert (m.key, m.majority, m.ranks) == ("model.w", (0, 1, 3), (2,))
    tie = mismatch_from_digests(MetadataIndex("b"), {0: 4, 1: 5})
    assert tie.majority == (0,) and tie.ranks == (1,)
    assert "rank [2] differ" in m.describe() or "rank [2]" in m.describe()


def test_per_rank_items_get_own_keys_and_nested_paths() -> None:
    plans = [_plan({"data": {"pos": 1}, "w": torch.ones(2)}), _plan({"data": {"pos": 2}, "w": torch.ones(2)})]
    idx = next(i.index for i in plans[0].items if i.index.fqn == "data.pos")
    g = create_global_save_plan(plans, ["n1", "n1"], frozenset({idx}))
    keys = set(g.metadata.state_dict_metadata)
    assert keys == {"_rslurm_per_rank.0.data.pos", "_rslurm_per_rank.1.data.pos", "w"}
    assert g.metadata.planner_data["_rslurm_per_rank.1.data.pos"] == ("_rslurm_per_rank", "1", "data", "pos")
    assert "data.pos" not in g.metadata.planner_data
    written = [{i.index.fqn for i in p.items} for p in g.plans]
    assert "_rslurm_per_rank.0.data.pos" in written[0] and "_rslurm_per_rank.1.data.pos" in written[1]
    assert sum("w" in w for w in written) == 1  # replicated and equal: once per domain


# --------------------------------------------------------------------------- real ranks
def _ranks(mode: str, world: int, tmp: Path, local_dirs: list[str], nodes: list[str] | None = None,
           extra: list[str] | None = None, env: dict[str, str] | None = None,
           per_rank_env: list[dict[str, str]] | None = None,
           prefixes: list[list[str]] | None = None) -> list[dict[str, Any]]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    pre = [{"RSLURM_LOCAL_DIR": local_dirs[r], "SLURMD_NODENAME": (nodes or ["n1"] * world)[r],
            **((per_rank_env or [{}] * world)[r])} for r in range(world)]
    run_ranks([WORKER, mode, "--out", str(out), *(extra or [])], world, tmp, timeout=180,
              env={"RSLURM_RUN_ID": "rep", "RSLURM_COLLECTIVE_TIMEOUT": "60", **(env or {})}, per_rank_env=pre,
              prefixes=prefixes)
    if mode == "topology":
        return [json.loads((out / f"topology.{r}.json").read_text()) for r in range(world)]
    return [torch.load(out / f"{mode}.{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.proc
def test_domains_follow_directories_not_node_names(tmp_path: Path) -> None:
    per_gpu = _ranks("topology", 3, tmp_path, [str(tmp_path / f"nvme{r}") for r in range(3)])
    assert per_gpu[0]["domains"] == ["n1-r0", "n1-r1", "n1-r2"]  # one NVMe per GPU: a domain each
    assert all(t["leader"] for t in per_gpu)
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "alias").symlink_to(shared, target_is_directory=True)
    mixed = _ranks("topology", 4, tmp_path,
                   [str(shared), str(tmp_path / "alias"), str(tmp_path / "own"), str(shared)],
                   nodes=["n1", "n1", "n2", "n3"])
    # n1's two ranks reach one directory by two paths; n3 writes into it too; n2 has its own.
    assert mixed[0]["domains"] == ["n1", "n1", "n2", "n1"]
    assert [t["leader"] for t in mixed] == [True, False, True, False]


@pytest.mark.proc
def test_a_directory_shared_across_hosts_is_found_by_probes(tmp_path: Path) -> None:
    """Real hostnames differ per rank (a UTS namespace each), so device and inode cannot be compared
    across them: the probe files find which hosts write into one shared directory."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a hostname per rank (CI runs as root)")
    shared, own = tmp_path / "pfs", tmp_path / "nvme-h3"
    dirs = [str(shared), str(shared), str(own), str(shared)]
    hosts = [["unshare", "--uts", "sh", "-c", f'hostname host{h} && exec "$0" "$@"'] for h in (1, 1, 3, 4)]
    topo = _ranks("topology", 4, tmp_path, dirs, nodes=["a", "a", "c", "d"], prefixes=hosts)
    assert topo[0]["domains"] == ["a", "a", "c", "a"]
    assert not list(shared.glob(".rslurm-probe-*")) and not list(own.glob(".rslurm-probe-*"))


def _events(root: Path, name: str) -> list[dict[str, Any]]:
    return [e for p in root.rglob("events.jsonl") for e in read_jsonl(p) if e["event"] == name]


@pytest.mark.proc
def test_a_desynchronised_replica_is_named_and_each_copy_restores(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "nvme")] * 3
    saved = _ranks("save", 3, tmp_path, dirs, extra=["--perturb-rank", "2"])
    assert all(s["error"] is None for s in saved)
    ev = _events(tmp_path / "nvme", "replica_mismatch")
    assert ev and {e["key"] for e in ev} == {"model.0.weight"}, ev
    assert all(e["ranks"] == [2] and e["majority"] == [0, 1] and e["step"] == 3 for e in ev)
    m = json.loads((tmp_path / "nvme" / "rep" / "step_000000000003" / "manifest.json").read_text())
    assert [x["key"] for x in m["extra"]["replica_mismatch"]] == ["model.0.weight"]
    restored = _ranks("restore", 3, tmp_path, dirs)
    for s, r in zip(saved, restored):
        assert r["error"] is None and r["step"] == 3
        for k in s["model"]:
            assert torch.equal(s["model"][k], r["model"][k]), k  # rank 2 gets its own (perturbed) copy
        assert r["cursor"] == s["cursor"]  # per-rank plain value under a shared key


@pytest.mark.proc
def test_state_declared_replicated_is_checked_not_digested_and_a_false_claim_is_caught(tmp_path: Path) -> None:
    """``replicated=["cursor"]`` is a lie here (each rank's cursor differs): the check names it, as it
    would a drifted DDP replica, and each rank's copy is still what it restores."""
    dirs = [str(tmp_path / "nvme")] * 2
    saved = _ranks("save", 2, tmp_path, dirs, extra=["--declare", "cursor"])
    ev = _events(tmp_path / "nvme", "replica_mismatch")
    assert {(e["key"], e["step"]) for e in ev} == {("cursor.pos", 2), ("cursor.pos", 3)}, ev
    restored = _ranks("restore", 2, tmp_path, dirs)
    assert [r["cursor"] for r in restored] == [s["cursor"] for s in saved]
    bad = _ranks("save", 2, tmp_path, dirs, extra=["--declare", "nope", "--first", "4"])
    assert all(s["error"] and "ConfigError" in s["error"] and "'nope'" in s["error"] for s in bad), bad


@pytest.mark.proc
def test_replica_check_fail_refuses_the_save_on_every_rank(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "nvme")] * 3
    saved = _ranks("save", 3, tmp_path, dirs, extra=["--perturb-rank", "1"], env={"RSLURM_REPLICA_CHECK": "fail"})
    for s in saved:
        assert s["error"] and s["error"].startswith("ReplicaMismatchError") and "model.0.weight" in s["error"], s
    assert checkpoint_entries(tmp_path / "nvme" / "rep") == ["step_000000000002"]
    failed = _events(tmp_path / "nvme", "save_failed")
    assert {e["rank"] for e in failed} == {0, 1, 2} and all(e["step"] == 3 for e in failed)


@pytest.mark.proc
def test_replicas_in_different_domains_are_compared_at_commit_for_free(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "n1"), str(tmp_path / "n2")]
    _ranks("save", 2, tmp_path, dirs, nodes=["n1", "n2"], extra=["--perturb-rank", "1"],
           env={"RSLURM_REPLICA_CHECK_BYTES": "0"})  # no digests of proven state: only the commit comparison
    ev = _events(tmp_path, "replica_mismatch")
    assert ev and all(e["found_by"] == "commit" and e["step"] == 3 for e in ev), ev
    assert {e["key"] for e in ev} == {"model.0.weight"}


@pytest.mark.proc
def test_per_rank_state_at_another_world_size_needs_a_rank_map(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "nvme")] * 2
    saved = _ranks("save", 2, tmp_path, dirs)
    refused = _ranks("restore", 3, tmp_path, [dirs[0]] * 3)
    for r in refused:
        assert r["error"] and r["error"].startswith("IncompatibleCheckpointError"), r
        assert "'cursor.pos'" in r["error"] and "saved by 2 ranks" in r["error"] and "rank_map" in r["error"]
    mapped = _ranks("restore", 3, tmp_path, [dirs[0]] * 3, extra=["--map", "2"])
    for r, m in enumerate(mapped):
        assert m["error"] is None and m["step"] == 3
        assert m["cursor"] == saved[r % 2]["cursor"]
        assert torch.equal(m["rng"], saved[r % 2]["rng"])


@pytest.mark.proc
def test_a_shard_missing_at_commit_means_no_domain_commits(tmp_path: Path) -> None:
    """Rank 1's shard is gone after its write (as if written elsewhere): neither domain may commit."""
    dirs = [str(tmp_path / "n1"), str(tmp_path / "n1"), str(tmp_path / "n2")]
    fault = [{}, {"RSLURM_FAILPOINTS": "after_shard_write=unlink"}, {}]
    saved = _ranks("save", 3, tmp_path, dirs, nodes=["n1", "n1", "n2"], per_rank_env=fault)
    for s in saved:
        assert s["error"] and "rank 1" in s["error"] and "__1_0.distcp" in s["error"], s["error"]
        assert "no domain committed" in s["error"]
    for d in ("n1", "n2"):
        assert checkpoint_entries(tmp_path / d / "rep") == [], d  # step 2 failed too (the failpoint hits every save)


@pytest.mark.proc
def test_a_failed_write_on_one_rank_commits_nowhere_and_keeps_older_steps(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "n1"), str(tmp_path / "n2")]
    _ranks("save", 2, tmp_path, dirs, nodes=["n1", "n2"])
    fault = [{}, {"RSLURM_FAILPOINTS": "before_shard_write=raise"}]
    (tmp_path / "out" / "save.0.pt").unlink()
    saved = _ranks("save", 2, tmp_path, dirs, nodes=["n1", "n2"], per_rank_env=fault, extra=["--first", "4"])
    for s in saved:
        assert s["error"] and "rank 1 could not write" in s["error"] and str(tmp_path / "n2") in s["error"], s["error"]
    for d in ("n1", "n2"):  # the first run's steps 2 and 3 are intact; the failed saves of 5 and 6 left nothing
        entries = checkpoint_entries(tmp_path / d / "rep")
        assert entries == ["step_000000000002", "step_000000000003"], (d, entries)
    restored = _ranks("restore", 2, tmp_path, dirs, nodes=["n1", "n2"])
    assert [r["step"] for r in restored] == [3, 3]



def _drain(dirs: list[str], nodes: list[str], lustre: Path) -> None:
    """Each node's ``rslurm daemon --once`` drains its directory to the POSIX tier ``lustre``."""
    for node, d in zip(nodes, dirs):
        r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], timeout=120,
                           capture_output=True, text=True,
                           env=clean_env({"RSLURM_LOCAL_DIR": d, "RSLURM_NODE_NAME": node, "RSLURM_RUN_ID": "rep",
                                          "RSLURM_DURABLE": str(lustre)}))
        assert r.returncode == 0, r.stderr


@pytest.mark.proc
@pytest.mark.parametrize("source", ["durable", "peer"])
def test_per_rank_state_of_a_lost_node_comes_back_from_the_durable_tier(tmp_path: Path, source: str) -> None:
    """Per-rank copies live in their rank's domain: when n2's directory is gone, n2's rank fetches the step
    from the durable tier (``peer_replicas=off`` at the restore) or copies it from n1's replica of it, and
    gets its own cursor and RNG state back, not n1's."""
    dirs, nodes = [str(tmp_path / "n1"), str(tmp_path / "n2")], ["n1", "n2"]
    lustre = tmp_path / "lustre"
    saved = _ranks("save", 2, tmp_path, dirs, nodes=nodes)
    assert saved[0]["cursor"] != saved[1]["cursor"]
    _drain(dirs, nodes, lustre)
    assert (lustre / "rep" / "step_000000000003" / "manifest.json").exists()
    shutil.rmtree(dirs[1])
    restored = _ranks("restore", 2, tmp_path, dirs, nodes=nodes,
                      env={"RSLURM_DURABLE": str(lustre), "RSLURM_PEER_REPLICAS": "off" if source == "durable" else "auto"})
    for s, r in zip(saved, restored):
        assert r["error"] is None and r["step"] == 3
        assert r["cursor"] == s["cursor"] and torch.equal(r["rng"], s["rng"])
        for k in s["model"]:
            assert torch.equal(s["model"][k], r["model"][k]), k
    ev = _events(tmp_path / "n2", "restore")
    assert [e["tier"] for e in ev] == [source], ev


@pytest.mark.proc
def test_show_and_export_name_what_is_stored_per_rank(tmp_path: Path) -> None:
    saved = _ranks("save", 2, tmp_path, [str(tmp_path / "nvme")] * 2)

    def rslurm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "resilient_slurm.cli", *args, "--local-dir", str(tmp_path / "nvme"),
                               "--run-id", "rep"], capture_output=True, text=True, env=clean_env(), timeout=120)

    show = rslurm("show", "3", "--json")
    assert show.returncode == 0, show.stderr
    keys = {k["key"]: k for k in json.loads(show.stdout)["keys"]}
    assert keys["cursor"]["per_rank"] == [0, 1] and keys["model"]["per_rank"] == []
    table = rslurm("show", "3")
    assert "PER RANK" in table.stdout and "_rslurm_per_rank" not in table.stdout
    out = tmp_path / "cursor.pt"
    ex = rslurm("export", "3", str(out), "--format", "torch", "--only", "cursor")
    assert ex.returncode == 0, ex.stderr
    got = torch.load(out, weights_only=True)
    assert got == {"_rslurm_per_rank": {"0": {"cursor": saved[0]["cursor"]}, "1": {"cursor": saved[1]["cursor"]}}}


@pytest.mark.proc
def test_a_step_saved_twice_is_never_restored_as_a_mix_of_the_two_saves(tmp_path: Path) -> None:
    """One step number, two saves: n2's copy of step 3 is from another save than n1's (here: its manifest's
    save time moved, as after a run that went back to step 2 and saved step 3 again where only n1 committed
    it). Restore skips step 3 and takes step 2. Then n2 loses step 3 and n1's copy is the other save: the
    durable tier's step 3 (the first save) is refused instead of fetched into n2, and step 2 is restored."""
    dirs, nodes = [str(tmp_path / "n1"), str(tmp_path / "n2")], ["n1", "n2"]
    lustre = tmp_path / "lustre"
    off = {"RSLURM_PEER_REPLICAS": "off"}
    saved = _ranks("save", 2, tmp_path, dirs, nodes=nodes, env=off)
    _drain(dirs, nodes, lustre)
    assert (lustre / "rep" / "step_000000000003" / "manifest.json").exists()

    def move_save_time(node: str) -> None:
        p = tmp_path / node / "rep" / "step_000000000003" / "manifest.json"
        m = json.loads(p.read_text())
        m["created_at"] += 1000.0
        p.write_text(json.dumps(m))

    move_save_time("n2")
    restored = _ranks("restore", 2, tmp_path, dirs, nodes=nodes, env=off)
    assert [r["step"] for r in restored] == [2, 2], restored
    # n2 loses step 3, and n1's copy is the other save (its save time moved too); the durable step 3 is
    # the first save: fetching it into n2 would pair it with n1's other save.
    shutil.rmtree(tmp_path / "n2" / "rep" / "step_000000000003")
    move_save_time("n1")
    restored = _ranks("restore", 2, tmp_path, dirs, nodes=nodes, env={**off, "RSLURM_DURABLE": str(lustre)})
    assert [r["step"] for r in restored] == [2, 2], restored
    assert not (tmp_path / "n2" / "rep" / "step_000000000003").exists(), "the other save was fetched into n2"
    for s, r in zip(saved, restored):
        assert r["error"] is None and r["cursor"] != s["cursor"]  # step 2's cursor, not step 3's
