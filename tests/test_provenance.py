"""Provenance in every manifest (checkpoint/provenance.py), ``rslurm show`` and ``rslurm diff``.

A real training program (tests/workers/provenance_worker.py) is copied into a temporary git repository
and run from another directory, with Slurm job variables set:

* the manifest records the repository's commit (that of the program, not of the working directory), a
  clean or dirty tree, the command line, the Python/torch/resilient_slurm versions, the world size and
  nodes, the Slurm job id, array index and restart count, and the user config with its sha256;
* ``rslurm show STEP --json`` prints it, and the table shows it;
* a step saved by another commit, restored, writes the ``code_version_changed`` event (fields as
  docs/telemetry.md says) and a warning; a step saved by the same commit does not;
* ``rslurm diff A B`` names a changed shape and the provenance that changed (exit 1), nothing for a
  step against itself (exit 0), exit 2 for a step that does not exist;
* a manifest without provenance (older checkpoints) and one with a malformed provenance still list,
  show, diff and restore;
* a program outside any git repository records null code fields; a config that is not JSON, too big
  or with non-string keys is refused when the Checkpointer is built.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, clean_env, read_jsonl, run_rslurm

import resilient_slurm
from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint.provenance import MAX_USER_CONFIG_BYTES, code_version
from resilient_slurm.errors import ConfigError
from resilient_slurm.manifest import read_manifest_file, step_dirname

WORKER = REPO / "tests" / "workers" / "provenance_worker.py"
sys.path.insert(0, str(WORKER.parent))
from provenance_worker import CONFIG  # noqa: E402

RUN = "prov"
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2",
         "SLURM_RESTART_COUNT": "3", "SLURM_JOB_NODELIST": "n[1-2]", "RSLURM_NODE_NAME": "n1"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def make_repo(where: Path) -> Path:
    repo = where / "code"
    repo.mkdir()
    shutil.copy(WORKER, repo / "train.py")
    git(repo, "init", "-q")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def run(program: Path, mode: str, cwd: Path, *extra: str) -> dict[str, Any]:
    out = cwd / "out"
    out.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(program), mode, str(cwd / "nvme"), str(out), *extra],
                          env=clean_env(SLURM), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads((out / f"{mode}.0.json").read_text())
    doc["stderr"] = proc.stderr
    return doc


def rslurm(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, "--local-dir", str(cwd / "nvme"), "--run-id", RUN, env={"RSLURM_NODE_NAME": "n1"},
                      cwd=cwd, timeout=300)


def manifest_path(cwd: Path, step: int) -> Path:
    return cwd / "nvme" / RUN / step_dirname(step) / "manifest.json"


def code_events(cwd: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(cwd / "nvme" / RUN / "events.jsonl") if e["event"] == "code_version_changed"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Step 3 saved by a clean tree at commit c1, step 4 by the same commit with an uncommitted change,
    then the change committed (c2) and the run resumed; step 6 saved with another output layer shape."""
    base = tmp_path_factory.mktemp("prov")
    repo = make_repo(base)
    work = base / "work"  # not in the repository: the commit must come from the program's directory
    work.mkdir()
    c1 = git(repo, "rev-parse", "HEAD")
    run(repo / "train.py", "save", work, "--step", "3")
    same = run(repo / "train.py", "resume", work)
    events_same_commit = code_events(work)
    with open(repo / "train.py", "a") as f:
        f.write("# a change\n")
    run(repo / "train.py", "save", work, "--step", "4")
    git(repo, "commit", "-q", "-am", "second")
    c2 = git(repo, "rev-parse", "HEAD")
    resumed = run(repo / "train.py", "resume", work)
    run(repo / "train.py", "save", work, "--step", "6", "--classes", "3")
    return {"repo": repo, "work": work, "c1": c1, "c2": c2, "same": same, "resumed": resumed,
            "events_same_commit": events_same_commit}


@pytest.mark.proc
def test_every_provenance_field_is_in_the_manifest(saved: dict[str, Any]) -> None:
    repo, work = saved["repo"], saved["work"]
    m = read_manifest_file(str(manifest_path(work, 3)))
    p = m.provenance
    assert p is not None
    assert p["code"] == {"git_commit": saved["c1"], "git_dirty": False, "git_root": str(repo.resolve()),
                         "program": str(repo / "train.py")}
    assert p["command_line"] == [str(repo / "train.py"), "save", str(work / "nvme"), str(work / "out"), "--step", "3"]
    assert p["python"] == platform.python_version() and p["torch"] == torch.__version__
    assert p["rslurm"] == resilient_slurm.__version__ and p["cuda"] is None and p["nccl"] is None
    assert p["world_size"] == 1 and p["nodes"] == ["n1"]
    assert p["slurm"] == {"job_id": "4242", "array_job_id": "4240", "array_task_id": "2", "restart_count": 3,
                          "job_nodelist": "n[1-2]"}
    assert p["config"] == CONFIG
    canonical = json.dumps(CONFIG, sort_keys=True, separators=(",", ":"))
    assert p["config_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()
    # A loop of its own, no framework imported (the Lightning and HF programs: tests/test_lightning.py, test_hf.py)
    assert p["integration"] is None and p["frameworks"] == {"lightning": None, "transformers": None, "accelerate": None}
    dirty = read_manifest_file(str(manifest_path(work, 4))).provenance
    assert dirty is not None and dirty["code"]["git_commit"] == saved["c1"] and dirty["code"]["git_dirty"] is True


@pytest.mark.proc
def test_a_changed_code_version_is_a_warning_event(saved: dict[str, Any]) -> None:
    from test_telemetry import check_records, read_docs

    assert saved["same"]["step"] == 3 and saved["events_same_commit"] == []
    assert saved["resumed"]["step"] == 4
    ev = code_events(saved["work"])
    assert len(ev) == 1, ev
    assert (ev[0]["step"], ev[0]["saved_commit"], ev[0]["commit"], ev[0]["rank"]) == (4, saved["c1"], saved["c2"], 0)
    check_records(read_docs(), ev)
    assert f"saved by code at git commit {saved['c1'][:12]}" in saved["resumed"]["stderr"]


@pytest.mark.proc
def test_a_step_saved_by_another_command_line_is_a_warning_event(saved: dict[str, Any]) -> None:
    """Two experiments that kept one run id resume each other's state: the restore names both command lines
    and says to give each its own run id (here the same program, resumed with other arguments)."""
    from test_telemetry import check_records, read_docs

    repo, work = saved["repo"], saved["work"]
    events = [e for e in read_jsonl(work / "nvme" / RUN / "events.jsonl") if e["event"] == "command_line_changed"]
    want = [str(repo / "train.py"), "save", str(work / "nvme"), str(work / "out"), "--step", "3"]
    assert [(e["step"], e["saved_command_line"], e["rank"]) for e in events][0] == (3, want, 0), events
    assert events[0]["command_line"] == [str(repo / "train.py"), "resume", str(work / "nvme"), str(work / "out")]
    check_records(read_docs(), events)
    assert "give each its own run id" in saved["same"]["stderr"] and "was saved by `" in saved["same"]["stderr"]


@pytest.mark.proc
def test_show_prints_the_provenance(saved: dict[str, Any]) -> None:
    work = saved["work"]
    proc = rslurm(work, "show", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["provenance"] == read_manifest_file(str(manifest_path(work, 3))).provenance
    proc = rslurm(work, "show", "4")
    assert proc.returncode == 0, proc.stderr
    assert f"code: git {saved['c1']} (uncommitted changes)" in proc.stdout
    assert "slurm job 4242  array 4240_2  restart 3  nodes n[1-2]" in proc.stdout
    assert f"config sha256 {doc['provenance']['config_sha256'][:16]}" in proc.stdout, proc.stdout


@pytest.mark.proc
def test_diff_names_changed_shapes_and_provenance(saved: dict[str, Any]) -> None:
    work = saved["work"]
    proc = rslurm(work, "diff", "3", "6", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    shapes = {d["key"]: (d["a"], d["b"]) for d in doc["shape"]}
    assert shapes == {"model.out.weight": ([2, 8], [3, 8]), "model.out.bias": ([2], [3]),
                      "opt.state.2.exp_avg": ([2, 8], [3, 8]), "opt.state.2.exp_avg_sq": ([2, 8], [3, 8]),
                      "opt.state.3.exp_avg": ([2], [3]), "opt.state.3.exp_avg_sq": ([2], [3])}
    assert doc["only_in_a"] == doc["only_in_b"] == [] and doc["dtype"] == []
    fields = {d["field"]: (d["a"], d["b"]) for d in doc["provenance"]}
    assert fields["code.git_commit"] == (saved["c1"], saved["c2"])
    assert set(fields) == {"code.git_commit", "command_line"}, fields
    text = rslurm(work, "diff", "3", "6")
    assert text.returncode == 1 and "~ model.out.weight  shape [2, 8] -> [3, 8]" in text.stdout, text.stdout
    same = rslurm(work, "diff", "3", f"{RUN}:3", "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["equal"] is True, same.stdout + same.stderr
    missing = rslurm(work, "diff", "3", "99")
    assert missing.returncode == 2 and "step 99 not found" in missing.stderr, missing.stderr


@pytest.mark.proc
def test_the_durable_manifest_keeps_the_provenance(saved: dict[str, Any], tmp_path: Path) -> None:
    """``rslurm daemon --once`` drains the steps to a POSIX durable tier: the durable manifest (written from
    the parsed local one) carries the same provenance, and ``show --tier durable`` prints it."""
    nvme, durable = tmp_path / "nvme", tmp_path / "lustre"
    shutil.copytree(saved["work"] / "nvme", nvme)
    r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"], capture_output=True,
                       text=True, timeout=180, env=clean_env({
                           "RSLURM_LOCAL_DIR": str(nvme), "RSLURM_NODE_NAME": "n1", "RSLURM_LOCAL_MIN_FREE": "1M",
                           "RSLURM_KEEP_LAST": "10", "RSLURM_DURABLE": str(durable)}))
    assert r.returncode == 0, r.stderr
    for step in (3, 4, 6):
        local = read_manifest_file(str(manifest_path(tmp_path, step))).provenance
        assert local is not None
        assert read_manifest_file(str(durable / RUN / step_dirname(step) / "manifest.json")).provenance == local
    shown = rslurm(tmp_path, "show", "4", "--tier", "durable", "--durable", str(durable), "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["tier"] == "durable" and doc["provenance"]["code"]["git_dirty"] is True


@pytest.mark.proc
def test_manifests_without_or_with_malformed_provenance_still_work(saved: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(saved["work"] / "nvme", work / "nvme")
    for step, prov in ((3, None), (4, {"code": 5, "command_line": [1, 2], "python": ["x"], "slurm": "no"})):
        path = manifest_path(work, step)
        d = json.loads(path.read_text())
        if prov is None:
            del d["provenance"]
        else:
            d["provenance"] = prov
        path.write_text(json.dumps(d))
    shown = rslurm(work, "show", "3", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["provenance"] is None, shown.stderr
    assert "provenance: none usable (saved by a resilient_slurm before provenance existed, or a damaged field" in \
        rslurm(work, "show", "3").stdout
    bad = rslurm(work, "show", "4", "--json")
    assert bad.returncode == 0, bad.stderr
    assert {k: v for k, v in json.loads(bad.stdout)["provenance"].items() if v is not None} == {}
    diff = rslurm(work, "diff", "3", "4", "--json")
    assert diff.returncode == 0, diff.stdout + diff.stderr  # neither has provenance: nothing to tell apart
    assert json.loads(diff.stdout)["provenance_recorded"] == {"a": False, "b": True}
    assert rslurm(work, "ls", "--json").returncode == 0
    # A step without provenance restores, and no code version event is written for it.
    path = manifest_path(work, 6)
    d = json.loads(path.read_text())
    del d["provenance"]
    path.write_text(json.dumps(d))
    from provenance_worker import Net

    torch.manual_seed(0)
    net = Net(3)
    state = {"model": net, "opt": torch.optim.AdamW(net.parameters(), lr=0.01), "epoch": 0}
    before = len(code_events(work))
    with Checkpointer(local_dir=str(work / "nvme"), run_id=RUN) as ck:
        assert ck.restore(state) == 6
    assert state["epoch"] == 1 and len(code_events(work)) == before


@pytest.mark.proc
def test_a_program_outside_git_records_null_code_fields(tmp_path: Path) -> None:
    shutil.copy(WORKER, tmp_path / "train.py")
    doc = run(tmp_path / "train.py", "save", tmp_path)
    code = read_manifest_file(str(manifest_path(tmp_path, 3))).provenance["code"]  # type: ignore[index]
    assert code == {"git_commit": None, "git_dirty": None, "git_root": None, "program": str(tmp_path / "train.py")}
    assert doc["provenance"]["code"] == code
    assert code_version(None) == {"git_commit": None, "git_dirty": None, "git_root": None}


@pytest.mark.parametrize("config,why", [
    ({"lr": torch.tensor(0.1)}, "JSON-serialisable"),
    ({"lr": float("nan")}, "JSON-serialisable"),
    ({1: "a"}, "must be a string"),
    ({"blob": "x" * MAX_USER_CONFIG_BYTES}, "more than"),
], ids=["tensor", "nan", "int-key", "too-big"])
def test_a_bad_config_is_refused_at_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 config: Any, why: str) -> None:
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    with pytest.raises(ConfigError, match=why):
        Checkpointer(local_dir=str(tmp_path), run_id=RUN, config=config)
    assert not (tmp_path / RUN).exists()


def test_one_program_spelled_another_way_is_the_same_command_line() -> None:
    """``train.py``, ``./train.py`` and the absolute path ``python -m`` gives are one program: no
    ``command_line_changed`` for them; other arguments or another program are."""
    from resilient_slurm.checkpoint.reporting import _same_command

    assert _same_command(["train.py", "--lr", "1"], ["./train.py", "--lr", "1"])
    assert _same_command(["/src/examples/train.py", "--lr", "1"], ["train.py", "--lr", "1"])
    assert not _same_command(["train.py", "--lr", "1"], ["train.py", "--lr", "2"])
    assert not _same_command(["train.py"], ["eval.py"]) and not _same_command(["train.py"], ["train.py", "-x"])
