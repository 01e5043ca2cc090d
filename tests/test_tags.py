"""Tags (``ckpt.tag``, ``rslurm tag`` / ``untag``): a tagged step survives the engine's retention, the
daemon's durable retention and eviction, and ``rslurm gc``, on the local, POSIX and S3 tiers; untagged,
it goes. A tag stands where a STEP is expected; ``ls`` shows tags, ``runs`` lists runs.

Real components: ranks as real processes over gloo (three ranks emulating two nodes), the real engine in
process for world size 1, ``rslurm`` and ``rslurm daemon --once`` as real processes, S3 over HTTP
(moto's server on loopback). Hostile tags files (garbage, links, FIFOs, another run's, too big) are
errors that name the file and delete nothing, never crashes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import s3_support
import torch
from conftest import REPO, checkpoint_entries, read_jsonl, run_ranks, run_rslurm, sdir
from s3_support import FAKE_ENV, MotoServer
from test_telemetry import TAG_ONLY, check_records, read_docs

from resilient_slurm import Checkpointer, ConfigError
from resilient_slurm.checkpoint.policy import RetentionPolicy
from resilient_slurm.errors import TagsFileError
from resilient_slurm.layout import StepTagged, TempKind, delete_durable_step, delete_step, list_run_dir
from resilient_slurm.storage.posix import PosixTier
from resilient_slurm.tags import (
    MAX_REMOVALS,
    TAGS_FILE,
    RunTags,
    check_tag_name,
    empty,
    merge,
    read_local_tags,
    tag_name_problem,
)
from resilient_slurm.telemetry import EVENTS_FILE

RUN = "tagged"
PREFIX = "ckpt"
WORKER = str(REPO / "tests" / "workers" / "tag_worker.py")

moto_server = s3_support.moto_server
s3_bucket = s3_support.s3_bucket

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="flock, xattrs and gloo as on Linux"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


# --------------------------------------------------------------------------------------------- helpers
def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step)), "step": step}


def rslurm(*args: str, env: Mapping[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, env={"RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_MIN_FREE": "1M", **(env or {})},
                      timeout=timeout)


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def ok_json(r: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(r))


def local_steps(root: Path, run: str = RUN) -> set[int]:
    names = [n for n in checkpoint_entries(root / run) if n != TAGS_FILE]
    assert not [n for n in names if ".tmp-" in n], f"temp directories left behind: {names}"
    return {int(n[5:]) for n in names}


class Durable:
    """The durable tier under test (a POSIX directory or an S3 prefix) and how to reach it."""

    def __init__(self, kind: str, tmp_path: Path, server: MotoServer | None = None, bucket: str | None = None):
        self.kind = kind
        self.server, self.bucket = server, bucket
        self.path = tmp_path / "lustre"
        self.url = str(self.path) if kind == "posix" else f"s3://{bucket}/{PREFIX}"

    @property
    def env(self) -> dict[str, str]:
        env = {"RSLURM_DURABLE": self.url}
        if self.kind == "s3":
            assert self.server is not None
            env.update(FAKE_ENV, RSLURM_S3_ENDPOINT_URL=self.server.endpoint, RSLURM_S3_PART_SIZE="5M")
        return env

    def _keys(self, run: str) -> list[str]:
        if self.kind == "posix":
            d = self.path / run
            return [str(p.relative_to(self.path)) for p in d.rglob("*") if p.is_file()] if d.exists() else []
        assert self.server is not None
        got = self.server.client().list_objects_v2(Bucket=self.bucket, Prefix=f"{PREFIX}/{run}/")
        return [o["Key"][len(PREFIX) + 1:] for o in got.get("Contents", [])]

    def steps(self, run: str = RUN) -> set[int]:
        """Committed steps (a root manifest)."""
        return {int(k.split("/")[1][5:]) for k in self._keys(run) if k.count("/") == 2 and k.endswith("/manifest.json")}

    def step_dirs(self, run: str = RUN) -> set[int]:
        """Every step with any object left."""
        return {int(k.split("/")[1][5:]) for k in self._keys(run) if k.split("/")[1].startswith("step_")}

    def read(self, name: str) -> bytes:
        if self.kind == "posix":
            return (self.path / name).read_bytes()
        assert self.server is not None
        return self.server.client().get_object(Bucket=self.bucket, Key=f"{PREFIX}/{name}")["Body"].read()

    def write(self, name: str, data: bytes) -> None:
        if self.kind == "posix":
            (self.path / name).write_bytes(data)
        else:
            assert self.server is not None
            self.server.client().put_object(Bucket=self.bucket, Key=f"{PREFIX}/{name}", Body=data)

    def tags(self, run: str = RUN) -> dict[str, int]:
        return RunTags.parse(self.read(f"{run}/{TAGS_FILE}"), source="test", run_id=run).tags


@pytest.fixture(params=["posix", "s3"])
def durable(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Durable:
    if request.param == "posix":
        d = Durable("posix", tmp_path)
    else:
        server = request.getfixturevalue("moto_server")
        d = Durable("s3", tmp_path, server, request.getfixturevalue("s3_bucket"))
    for k, v in d.env.items():  # the in-process Checkpointer reaches the tier as the CLI does
        monkeypatch.setenv(k, v)
    return d


@pytest.fixture
def n1(monkeypatch: pytest.MonkeyPatch) -> str:
    """In-process saves belong to node n1, as the rslurm processes below."""
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    for k in ("RSLURM_KEEP_LAST", "RSLURM_KEEP_EVERY", "RSLURM_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    return "n1"


def save(root: Path, steps: list[int], *, run: str = RUN, keep_last: int = 10,
         tags: Mapping[int, str] | None = None) -> None:
    """Commit ``steps`` with the real engine (blocking saves), tagging some with ``ckpt.tag``."""
    with Checkpointer(local_dir=str(root), run_id=run, keep_last=keep_last) as ck:
        for s in steps:
            ck.save(s, state_of(s))
            if tags and s in tags:
                ck.tag(s, tags[s])


# ------------------------------------------------------------------------------------ names, merge, policy
@pytest.mark.parametrize("name", ["best", "v1.0", "run_2-a", "1st", "a" * 64, "0x10", "A.b_c-D"])
def test_valid_tag_names(name: str) -> None:
    assert tag_name_problem(name) is None and check_tag_name(name) == name


@pytest.mark.parametrize("name", ["", "123", "0", "a/b", "../x", ".hidden", "-x", "_x", "a b", "a" * 65, "é",
                                  "a\0b", "best\n", 5, None])
def test_invalid_tag_names(name: Any) -> None:
    assert tag_name_problem(name) is not None
    with pytest.raises(ConfigError, match="invalid tag name"):
        check_tag_name(name)


def test_copies_merge_name_by_name_newest_record_winning() -> None:
    base = empty(RUN).tagged("best", 10, now=100.0).tagged("keep", 5, now=100.0)
    node = base.tagged("best", 20, now=200.0)  # a compute node moved "best" later
    login = base.untagged("keep", now=150.0)  # a login node untagged "keep"
    merged = merge(RUN, [node, login])
    assert merged.tags == {"best": 20} and merged.steps == {20}
    assert merge(RUN, [login, node]).records == merged.records  # order does not matter
    # An untag beats an older tag still in a stale copy, and a newer tag beats the untag.
    assert node.merged(login).tags == {"best": 20}
    assert login.merged(base.tagged("keep", 7, now=300.0)).tags == {"keep": 7, "best": 10}
    # At the same time, a tag beats a removal (keeping a step is the safe side).
    tie = empty(RUN).tagged("x", 3, now=50.0)
    assert tie.merged(RunTags(RUN, {"x": type(tie.records["x"])(3, 50.0, removed=True)})).tags == {"x": 3}
    # A change is stamped later than the record it replaces even when that came from a clock ahead of ours.
    ahead = empty(RUN).tagged("y", 1, now=10_000.0)
    assert ahead.untagged("y", now=5.0).records["y"].at > 10_000.0
    assert merge(RUN, [ahead, ahead.untagged("y", now=5.0)]).tags == {}
    # The file round-trips, and equal tags are equal bytes.
    data = merged.to_json()
    assert RunTags.parse(data, source="x", run_id=RUN).records == merged.records
    assert RunTags.parse(data, source="x", run_id=RUN).to_json() == data
    # Removal records are bounded: the oldest go.
    many = empty(RUN)
    for i in range(MAX_REMOVALS + 10):
        many = many.tagged(f"t{i}", i, now=float(i)).untagged(f"t{i}", now=float(i) + 0.5)
    assert len(many.records) == MAX_REMOVALS and "t0" not in many.records and f"t{MAX_REMOVALS + 9}" in many.records


def test_policy_never_deletes_a_protected_step() -> None:
    p = RetentionPolicy(keep_last=1)
    assert p.deletable([1, 2, 3, 4]) == [1, 2, 3]
    assert p.deletable([1, 2, 3, 4], protected=[2]) == [1, 3]
    assert p.deletable([1, 2, 3, 4], invalid=[2, 3], protected=[3]) == [1, 2]
    assert RetentionPolicy(keep_last=2, keep_every=2).deletable(range(1, 9), protected={1}) == [3, 5]


# ------------------------------------------------------------------------------------ hostile tags files
def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


HOSTILE = {
    "empty": (b"", "not valid JSON"),
    "truncated": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {', "not valid JSON"),
    "not an object": (b"[1, 2]", "rslurm-tags"),
    "nested deeply": (_deep(100_000), "nested too deeply"),
    "other format": (b'{"format": "x", "version": 1, "run_id": "tagged"}', "rslurm-tags"),
    "newer": (b'{"format": "rslurm-tags", "version": 99, "run_id": "tagged"}', "newer resilient_slurm"),
    "other run": (b'{"format": "rslurm-tags", "version": 1, "run_id": "other"}', "names run 'other'"),
    "tags a list": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": []}', "must be an object"),
    "bad name": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"../x": {"step": 1, "at": 1}}}',
                 "letters, digits"),
    "digits name": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"12": {"step": 1, "at": 1}}}',
                    "only digits"),
    "negative step": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": -1, "at": 1}}}',
                      "not a step number"),
    "bool step": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": true, "at": 1}}}',
                  "not a step number"),
    "NaN time": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": 1, "at": NaN}}}',
                 "not valid JSON"),
    "huge time": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": 1, "at": 1e999}}}',
                  "out of range"),
    "far-future time": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": 1, "at": 1e300}}}',
                        "not a time"),
    "extra field": (b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"a": {"step": 1}}}',
                    "expected {step, at}"),
    "too big": (b" " * (2 << 20), "larger than a tags file may be"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tags_file_is_an_error_naming_it(case: str, tmp_path: Path) -> None:
    data, why = HOSTILE[case]
    run_dir = tmp_path / RUN
    run_dir.mkdir()
    (run_dir / TAGS_FILE).write_bytes(data)
    with pytest.raises(TagsFileError) as err:
        read_local_tags(str(run_dir), RUN)
    msg = str(err.value)
    assert why in msg and str(run_dir / TAGS_FILE) in msg and f"No step of run {RUN} is deleted" in msg, msg


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_tags_file_that_is_not_a_regular_file_is_refused_unread(kind: str, tmp_path: Path) -> None:
    run_dir = tmp_path / RUN
    run_dir.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(empty(RUN).tagged("best", 1).to_json())
    where = run_dir / TAGS_FILE
    if kind == "symlink":
        where.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(where)  # opening it must not block
    else:
        where.mkdir()
    with pytest.raises(TagsFileError, match="not a regular file|cannot be read"):
        read_local_tags(str(run_dir), RUN)


def test_deletion_protocols_refuse_tagged_steps(tmp_path: Path, n1: str) -> None:
    """The one deletion protocol of each tier checks the tags itself: no caller can forget to."""
    root = tmp_path / "nvme"
    save(root, [1, 2, 3], tags={1: "best"})
    run_dir = str(root / RUN)
    with pytest.raises(StepTagged):
        delete_step(run_dir, 1, TempKind.GC)
    assert list_run_dir(run_dir).committed == [1, 2, 3]
    assert delete_step(run_dir, 2, TempKind.GC) is True
    (root / RUN / TAGS_FILE).write_bytes(b"{ garbage")
    with pytest.raises(TagsFileError):
        delete_step(run_dir, 3, TempKind.GC)  # which steps are tagged is unknown: nothing goes
    assert list_run_dir(run_dir).committed == [1, 3]

    tier = PosixTier(str(tmp_path / "lustre"))
    tier.put_bytes(f"{RUN}/{sdir(4)}/manifest.json", b"{}")
    tier.put_bytes(f"{RUN}/{TAGS_FILE}", empty(RUN).tagged("v", 4).to_json())
    with pytest.raises(StepTagged):
        delete_durable_step(tier, RUN, 4)
    assert (tmp_path / "lustre" / RUN / sdir(4) / "manifest.json").exists()


# ------------------------------------------------------------------------------------ ckpt.tag, real ranks
@pytest.mark.proc
def test_ckpt_tag_in_a_real_run_survives_local_retention(tmp_path: Path) -> None:
    """Three ranks on two emulated nodes (n1: ranks 0 and 1, n2: rank 2), keep_last=1: the tagged steps stay
    in both domains, the rest goes; a tag of the step in flight waits for its commit; a bad name or a step
    retention removed fails on every rank alike, the non-leader rank 1 included."""
    nvme, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    run_ranks([WORKER, "--local-dir", str(nvme / "%n"), "--run-id", RUN, "--out", str(out)], 3, tmp_path,
              env={"RSLURM_CONTROL_SOCKET": "off", "RSLURM_COLLECTIVE_TIMEOUT": "60"},
              per_rank_env=[{"RSLURM_NODE_NAME": n} for n in ("n1", "n1", "n2")], timeout=240)
    for node in ("n1", "n2"):
        assert local_steps(nvme / node) == {2, 4, 6}, node
        tags = read_local_tags(str(nvme / node / RUN), RUN)
        assert tags is not None and tags.tags == {"best": 2, "v1": 4}, node
    for r in range(3):
        res = json.loads((out / f"rank{r}.json").read_text())
        assert "cannot tag step 3" in res["gone"] and "not committed" in res["gone"], (r, res)
        assert "invalid tag name" in res["bad"], (r, res)

    # Each node's leader wrote a `tagged` event per tag, as docs/telemetry.md says.
    docs = read_docs()
    for node, rank in (("n1", 0), ("n2", 2)):
        events = [e for e in read_jsonl(nvme / node / RUN / EVENTS_FILE) if e["event"] in TAG_ONLY]
        check_records(docs, events)
        assert [(e["rank"], e["step"], e["tag"], e["moved_from"]) for e in events] == [
            (rank, 2, "best", None), (rank, 4, "v1", None), (rank, 5, "best", 2), (rank, 2, "best", 5)]

    # ls shows each step's tags (both domains' copies, merged).
    doc = ok_json(rslurm("ls", "--json", env={"RSLURM_LOCAL_DIR": str(nvme / "%n")}))
    assert {r["step"]: r["tags"] for r in doc["steps"]} == {2: ["best"], 4: ["v1"], 6: []}
    table = ok(rslurm("ls", env={"RSLURM_LOCAL_DIR": str(nvme / "%n")}))
    assert "TAGS" in table and any(ln.split()[:3] == [RUN, "2", "best"] for ln in table.splitlines()), table


def test_tagging_the_step_in_flight_then_retention(tmp_path: Path, n1: str) -> None:
    """World size 1: an async save's step tagged at once is kept by every later retention."""
    root = tmp_path / "nvme"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=1) as ck:
        ck.save(1, state_of(1), blocking=False)
        ck.tag(1, "first")  # in flight: waits for the commit, then tags
        for s in (2, 3):
            ck.save(s, state_of(s))
        with pytest.raises(ConfigError, match="not committed"):
            ck.tag(2, "late")  # removed by retention
        with pytest.raises(ConfigError, match="invalid tag name"):
            ck.tag(3, "99")
    assert local_steps(root) == {1, 3}


# ------------------------------------------------------------------------------------ durable tiers
@pytest.mark.proc
def test_tagged_step_survives_durable_retention_and_gc(tmp_path: Path, n1: str, durable: Durable) -> None:
    """keep_last=1 everywhere: the tagged step is drained (retention alone would not send it), kept by the
    daemon's durable retention and by gc on both tiers; untagged, the daemon and gc remove it."""
    root = tmp_path / "nvme"
    env = {"RSLURM_LOCAL_DIR": str(root), "RSLURM_KEEP_LAST": "1", **durable.env}
    save(root, [1, 2, 3, 4], tags={1: "best"})
    assert durable.tags() == {"best": 1}  # rank 0 copied the tags to the durable tier itself

    err = ok(rslurm("daemon", "--once", env=env))
    assert durable.steps() == {1, 4}, err
    assert durable.step_dirs() == {1, 4}, "a step retention does not keep was uploaded"

    # gc: local step 3 is the newest one not durable (the daemon may still drain it): kept as always.
    dry = ok_json(rslurm("gc", "--dry-run", "--json", env=env))
    assert {(a["tier"], a["step"]) for a in dry["actions"]} == {("local", 2)}, dry
    ok(rslurm("gc", env=env))
    assert local_steps(root) == {1, 3, 4} and durable.steps() == {1, 4}

    # Tag from "a login node" (the durable copy only), and locally only: the daemon brings both in step.
    ok(rslurm("tag", "--tier", "durable", "4", "latest", env=env))
    assert durable.tags() == {"best": 1, "latest": 4}
    assert read_local_tags(str(root / RUN), RUN).tags == {"best": 1}  # type: ignore[union-attr]
    ok(rslurm("daemon", "--once", env=env))
    assert read_local_tags(str(root / RUN), RUN).tags == {"best": 1, "latest": 4}  # type: ignore[union-attr]

    # Untag: the removal reaches both copies; the daemon's retention and gc then remove step 1.
    change = ok_json(rslurm("untag", "1", "best", "--json", env=env))
    assert change["action"] == "untagged" and len(change["written"]) == 2, change
    save(root, [5], keep_last=1)  # the engine's retention: step 1 no longer tagged, 4 is
    assert local_steps(root) == {4, 5}
    ok(rslurm("daemon", "--once", env=env))
    assert durable.steps() == {4, 5}, "the untagged step survived durable retention"
    assert durable.tags() == {"latest": 4}


@pytest.mark.proc
def test_eviction_never_removes_a_tagged_step(tmp_path: Path, n1: str) -> None:
    root, lustre = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_LOCAL_DIR": str(root), "RSLURM_DURABLE": str(lustre), "RSLURM_KEEP_LAST": "10"}
    save(root, [1, 2, 3, 4])
    ok(rslurm("daemon", "--once", env=env))
    ok(rslurm("tag", "1", "best", env=env))
    st = os.statvfs(root)
    impossible = str(2 * st.f_blocks * st.f_frsize)  # more than the filesystem holds
    r = rslurm("daemon", "--once", "--local-min-free", impossible, env=env)
    evicted = [int(ln.split("evicted run ")[1].split()[2]) for ln in r.stderr.splitlines() if "evicted run " in ln]
    assert evicted == [2, 3, 4], r.stderr
    assert local_steps(root) == {1}
    assert "tagged steps" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------ STEP by tag, ls, runs
@pytest.mark.proc
def test_a_tag_stands_for_its_step_and_runs_lists_runs(tmp_path: Path, n1: str) -> None:
    root, lustre = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_LOCAL_DIR": str(root), "RSLURM_DURABLE": str(lustre)}
    save(root, [1, 2, 3], run="alpha")
    ok(rslurm("daemon", "--once", env=env))
    save(root, [5], run="beta")  # local only: not drained
    (root / "gamma").mkdir()  # a run directory with nothing in it yet
    tagged = ok_json(rslurm("tag", "--run-id", "alpha", "2", "best", "--json", env=env))
    assert tagged["moved_from"] is None and len(tagged["written"]) == 2
    moved = ok(rslurm("tag", "--run-id", "alpha", "3", "best", env=env))
    assert "moved from step 2" in moved, moved
    ok(rslurm("tag", "--run-id", "alpha", "2", "best", env=env))

    show = ok_json(rslurm("show", "--run-id", "alpha", "best", "--json", env=env))
    assert (show["step"], show["tags"]) == (2, ["best"])
    assert "OK" in ok(rslurm("verify", "--run-id", "alpha", "best", env=env))
    out = tmp_path / "best.pt"
    ok(rslurm("export", "--run-id", "alpha", "best", str(out), "--format", "torch", env=env))
    sd = torch.load(out, weights_only=True)
    assert sd["_rslurm_step"] == 2 and torch.equal(sd["w"], state_of(2)["w"])
    # From the durable tier alone (a login node without the NVMe): the tag is read from there.
    durable_only = {**env, "RSLURM_LOCAL_DIR": str(tmp_path / "empty")}
    show = ok_json(rslurm("show", "--run-id", "alpha", "best", "--json", env=durable_only))
    assert (show["step"], show["tier"], show["tags"]) == (2, "durable", ["best"])

    rows = {r["step"]: r["tags"] for r in ok_json(rslurm("ls", "--run-id", "alpha", "--json", env=env))["steps"]}
    assert rows == {1: [], 2: ["best"], 3: []}

    doc = ok_json(rslurm("runs", "--json", env=env))
    runs = {r["run_id"]: r for r in doc["runs"]}
    assert sorted(runs) == ["alpha", "beta", "gamma"] and doc["errors"] == []
    a, b = runs["alpha"], runs["beta"]
    assert (a["state"], a["steps"], a["first_step"], a["last_step"], a["tags"]) == ("durable", 3, 1, 3, {"best": 2})
    assert a["durable"]["steps"] == 3 and a["local"]["steps"] == 3 and a["bytes"] == a["durable"]["bytes"] > 0
    assert (b["state"], b["steps"], b["first_step"], b["last_step"]) == ("committed", 1, 5, 5)
    assert b["durable"]["steps"] == 0 and b["local"]["bytes"] > 0 and b["tags"] == {}
    assert runs["gamma"]["state"] == "empty" and runs["gamma"]["steps"] == 0
    only = ok_json(rslurm("runs", "--tier", "durable", "--json", env=env))
    assert [r["run_id"] for r in only["runs"]] == ["alpha"] and only["runs"][0]["local"] is None
    table = ok(rslurm("runs", env=env))
    assert any(ln.split()[:5] == ["alpha", "durable", "3", "1", "3"] and "best=2" in ln
               for ln in table.splitlines()), table


@pytest.mark.parametrize("args,why", [
    (["tag", "1", "123"], "only digits"),
    (["tag", "1", "../x"], "letters, digits"),
    (["tag", "1", "a" * 65], "1 to 64"),
    (["untag", "1", "a b"], "letters, digits"),
    (["show", "x/y"], "step number or a tag"),
    (["show", "nosuch"], "has no tag 'nosuch'"),
    (["export", "nosuch", "{tmp}/out.pt", "--format", "torch"], "has no tag 'nosuch'"),
    (["tag", "99", "x"], "step 99 not found"),
    (["untag", "1", "nosuch"], "has no tag 'nosuch'"),
    (["untag", "2", "best"], "is on step 1, not step 2"),
])
@pytest.mark.proc
def test_bad_names_and_steps_exit_2(args: list[str], why: str, tmp_path: Path, n1: str) -> None:
    root = tmp_path / "nvme"
    save(root, [1, 2], tags={1: "best"})
    before = (root / RUN / TAGS_FILE).read_bytes()
    r = rslurm(*(a.replace("{tmp}", str(tmp_path)) for a in args), env={"RSLURM_LOCAL_DIR": str(root)})
    assert r.returncode == 2 and why in r.stderr, f"exit {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    assert (root / RUN / TAGS_FILE).read_bytes() == before and local_steps(root) == {1, 2}


# ------------------------------------------------------------------------------------ corrupt tags files
@pytest.mark.proc
def test_a_corrupt_local_tags_file_stops_every_deletion(tmp_path: Path, n1: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    root, lustre = tmp_path / "nvme", tmp_path / "lustre"
    env = {"RSLURM_LOCAL_DIR": str(root), "RSLURM_DURABLE": str(lustre), "RSLURM_KEEP_LAST": "1"}
    save(root, [1, 2, 3])
    ok(rslurm("daemon", "--once", env={**env, "RSLURM_KEEP_LAST": "10"}))
    bad = root / RUN / TAGS_FILE
    bad.write_bytes(b'{"format": "rslurm-tags", "version": 1, "run_id": "tagged", "tags": {"best": {"step": 1')

    gc = rslurm("gc", env=env)
    assert gc.returncode == 1 and f"tags file {bad}: not valid JSON" in gc.stderr, gc.stderr
    assert "nothing in it was deleted" not in gc.stderr, gc.stderr  # a directory's tail: the message says it all
    assert local_steps(root) == {1, 2, 3} and Durable("posix", tmp_path).steps() == {1, 2, 3}
    ls = rslurm("ls", "--json", env=env)
    # A fault in the data (exit 1), not a store that could not be reached (2): every step is still listed.
    assert ls.returncode == 1 and str(bad) in "".join(json.loads(ls.stdout)["errors"]), ls.stdout
    assert len(json.loads(ls.stdout)["steps"]) == 3
    runs = rslurm("runs", env=env)
    assert runs.returncode == 1 and str(bad) in runs.stderr and "tagged" in runs.stdout, (runs.stdout, runs.stderr)
    row = next(line for line in runs.stdout.splitlines() if line.split() and line.split()[0] == RUN)
    assert " ? " in row, row  # its tags are not known, which "-" (no tags) would not say
    tag = rslurm("tag", "3", "x", env=env)
    assert tag.returncode == 1 and str(bad) in tag.stderr and "Traceback" not in tag.stderr, tag.stderr
    d = rslurm("daemon", "--once", env=env)
    assert "Traceback" not in d.stderr and f"tags file {bad}" in d.stderr, d.stderr
    assert Durable("posix", tmp_path).steps() == {1, 2, 3}, "durable retention ran without the tags"

    caplog.set_level(logging.WARNING, logger="resilient_slurm")
    save(root, [4], keep_last=1)  # the engine's retention: nothing goes
    assert local_steps(root) == {1, 2, 3, 4}
    assert any("retention" in r.getMessage() and str(bad) in r.getMessage() for r in caplog.records)
    assert bad.read_bytes().endswith(b'{"step": 1'), "a tags file that could not be read was overwritten"

    bad.unlink()  # moved away: deletions resume
    ok(rslurm("gc", env=env))
    assert local_steps(root) == {4}


@pytest.mark.proc
def test_a_corrupt_durable_tags_file_stops_durable_deletions(tmp_path: Path, n1: str, durable: Durable) -> None:
    root = tmp_path / "nvme"
    env = {"RSLURM_LOCAL_DIR": str(root), **durable.env}
    save(root, [1, 2, 3])
    ok(rslurm("daemon", "--once", env=env))
    assert durable.steps() == {1, 2, 3}
    durable.write(f"{RUN}/{TAGS_FILE}", b"\x00\xff not json")
    d = rslurm("daemon", "--once", env={**env, "RSLURM_KEEP_LAST": "1"})
    assert "Traceback" not in d.stderr and f"{RUN}/{TAGS_FILE}: not valid JSON" in d.stderr, d.stderr
    assert durable.steps() == {1, 2, 3}
    gc = rslurm("gc", "--keep-last", "1", env=env)
    assert gc.returncode == 1 and "not valid JSON" in gc.stderr, gc.stderr
    assert durable.steps() == {1, 2, 3} and local_steps(root) == {1, 2, 3}
    assert durable.read(f"{RUN}/{TAGS_FILE}") == b"\x00\xff not json"
