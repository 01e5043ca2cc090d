"""The local tier's layout (resilient_slurm/layout.py): temp kinds, run listings, and the one deletion
protocol, against real directories, links, locks and processes; and a source check that no other module
lists run directories or matches temp names by hand."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_slurm.layout import (
    StepBusy,
    TempKind,
    delete_step,
    list_run_dir,
    list_runs,
    parse_temp_dirname,
    temp_dirname,
)
from resilient_slurm.manifest import MANIFEST_NAME, step_dirname

PKG = Path(__file__).resolve().parents[1] / "resilient_slurm"


def _step(run_dir: Path, step: int, *, manifest: bool = True) -> Path:
    d = run_dir / step_dirname(step)
    d.mkdir(parents=True)
    (d / "shard_00000.distcp").write_bytes(b"x" * 10)
    if manifest:
        (d / MANIFEST_NAME).write_text("{}")
    return d


@pytest.mark.parametrize("kind", list(TempKind))
def test_temp_names_round_trip(kind: TempKind) -> None:
    name = temp_dirname(42, kind, "ab12cd-3")
    t = parse_temp_dirname(name)
    assert t is not None and (t.step, t.kind) == (42, kind) and t.owned_by("ab12cd") and not t.owned_by("ffff")
    assert t.kind.deleting == (kind in (TempKind.REPLACED, TempKind.GC, TempKind.EVICT))


@pytest.mark.parametrize("name", ["step_000000000001", "step_1.tmp-x", "step_000000000001.tmp-", "other.tmp-x",
                                  "step_000000000001.tmp-a/b", "step_000000000001.tmp-a b"])
def test_non_temp_names_are_not_parsed(name: str) -> None:
    assert parse_temp_dirname(name) is None


def test_listing_sorts_steps_temps_and_foreign_entries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for s in (12, 4, 8):
        _step(run, s)
    _step(run, 16, manifest=False)
    for kind, step in ((TempKind.SAVE, 20), (TempKind.FETCH, 16), (TempKind.GC, 4), (TempKind.EVICT, 3),
                       (TempKind.REPLACED, 8)):
        (run / temp_dirname(step, kind, "n0nce-1")).mkdir()
    outside = tmp_path / "outside"
    _step(outside, 24)
    (run / step_dirname(24)).symlink_to(outside / step_dirname(24))
    (run / step_dirname(28)).write_text("a file")
    (run / "notes.txt").write_text("ignored")
    got = list_run_dir(str(run))
    assert got.committed == [4, 8, 12] and got.uncommitted == [16]
    assert [(t.step, t.kind) for t in got.in_progress()] == [(16, TempKind.FETCH), (20, TempKind.SAVE)]
    assert {t.kind for t in got.temps if t.kind.deleting} == {TempKind.GC, TempKind.EVICT, TempKind.REPLACED}
    assert got.foreign == [step_dirname(24), step_dirname(28)]
    assert list_run_dir(str(tmp_path / "missing")).committed == []


def test_a_run_directory_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    _step(tmp_path / "elsewhere", 4)
    root = tmp_path / "root"
    root.mkdir()
    (root / "run").symlink_to(tmp_path / "elsewhere")
    (root / "real").mkdir()
    (root / ".rslurm").mkdir()
    with pytest.raises(OSError, match="symbolic link"):
        list_run_dir(str(root / "run"))
    assert list_runs(str(root)) == ["real"]
    assert list_runs(str(tmp_path / "nothing")) == []


def test_delete_uncommits_then_removes_and_never_follows_links(tmp_path: Path) -> None:
    run = tmp_path / "run"
    d = _step(run, 4)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    (d / "link").symlink_to(victim)
    assert delete_step(str(run), 4, TempKind.GC) is True
    assert os.listdir(run) == [] and (victim / "keep").read_text() == "precious"
    assert delete_step(str(run), 4, TempKind.GC) is False  # already gone


def test_delete_refuses_a_step_entry_that_is_a_link(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = _step(tmp_path / "elsewhere", 4)
    (run / step_dirname(4)).symlink_to(target)
    with pytest.raises(OSError, match="not a directory made by rslurm"):
        delete_step(str(run), 4, TempKind.EVICT)
    assert (target / MANIFEST_NAME).exists() and (run / step_dirname(4)).is_symlink()


def test_delete_with_a_manifest_that_is_a_link_leaves_its_target(tmp_path: Path) -> None:
    run = tmp_path / "run"
    d = _step(run, 4, manifest=False)
    target = tmp_path / "target.json"
    target.write_text("{}")
    (d / MANIFEST_NAME).symlink_to(target)
    assert delete_step(str(run), 4, TempKind.GC) is True
    assert target.read_text() == "{}" and not (run / step_dirname(4)).exists()


@pytest.mark.proc
def test_a_step_being_read_by_another_process_is_not_deleted(tmp_path: Path) -> None:
    """A reader in another process holds a shared flock on the manifest (as restore and the daemon's
    drain do): the deletion reports StepBusy and leaves the step committed; once it lets go, it goes."""
    run = tmp_path / "run"
    d = _step(run, 4)
    reader = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); "
         "print('locked', flush=True); sys.stdin.read()", str(d / MANIFEST_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "locked"
        with pytest.raises(StepBusy):
            delete_step(str(run), 4, TempKind.GC)
        assert list_run_dir(str(run)).committed == [4]
    finally:
        assert reader.stdin is not None
        reader.stdin.close()
        reader.wait(timeout=30)
    assert delete_step(str(run), 4, TempKind.GC) is True


@pytest.mark.proc
def test_a_crash_after_the_uncommit_leaves_a_temp_directory_not_a_step(tmp_path: Path) -> None:
    """SIGKILL between the uncommit and the removal (failpoint ``during_retention``): what is left is a
    GC temp directory, which no reader takes for a committed step."""
    run = tmp_path / "run"
    _step(run, 4)
    _step(run, 8)
    code = "import sys; from resilient_slurm import layout; layout.delete_step(sys.argv[1], 4, layout.TempKind.GC)"
    env = {**os.environ, "PYTHONPATH": str(PKG.parent), "RSLURM_FAILPOINTS": "during_retention=kill"}
    proc = subprocess.run([sys.executable, "-c", code, str(run)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    got = list_run_dir(str(run))
    assert got.committed == [8] and [(t.step, t.kind) for t in got.temps] == [(4, TempKind.GC)]


# Modules that may list a local run directory or take temp names apart: the layout module, and the
# manifest module that builds the names.
LAYOUT_OWNERS = {"layout.py", "manifest.py"}


def _calls(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.add(f"{f.value.id}.{f.attr}")
            elif isinstance(f, ast.Name):
                out.add(f.id)
    return out


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.name not in LAYOUT_OWNERS),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_other_module_scans_steps_or_matches_temp_names(path: Path) -> None:
    """A module that parses step-directory names does not list directories itself, and nothing outside
    the layout matches ``.tmp-`` names by hand: one owner of discovery (issue: seven scanners had
    drifted apart, e.g. in which temp directories count as saves in progress)."""
    text = path.read_text()
    tree = ast.parse(text)
    calls = _calls(tree)
    lists = calls & {"os.listdir", "os.scandir"}
    assert not (lists and "parse_step_dirname" in calls), f"{path.name} lists a directory and parses step names"
    assert "is_tmp_dirname" not in calls and "tmp_dirname" not in calls, f"{path.name}: use layout.temp_dirname"
    assert '.tmp-")' not in text and "'.tmp-'" not in text, f"{path.name} splits temp names by hand"


def test_the_source_check_sees_a_scanner() -> None:
    bad = ast.parse("import os\nfor n in os.listdir(d):\n    parse_step_dirname(n)\n")
    assert {"os.listdir", "parse_step_dirname"} <= _calls(bad)


def test_listing_never_opens_a_manifest(tmp_path: Path) -> None:
    """Discovery only looks at names and entry types: a FIFO where a manifest goes (opening it would block)
    is listed as a committed step in no time, and the manifest reader refuses it later."""
    run = tmp_path / "run"
    d = _step(run, 4, manifest=False)
    os.mkfifo(d / MANIFEST_NAME)
    assert list_run_dir(str(run)).committed == [4]


_TIER_METHODS = {"get_bytes", "put_bytes", "stat", "list_dirs", "get_file", "put_file", "delete", "delete_prefix",
                 "list", "list_incomplete", "cleanup_incomplete"}


def _hand_built_keys(tree: ast.AST) -> list[str]:
    """Calls of a storage-tier method whose key is an f-string or a concatenation: a durable key built by
    hand instead of by ``manifest.durable_step_key`` / ``domain_key`` / ``durable_run_key``."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TIER_METHODS):
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id in {"os", "shutil", "json", "Path"}:
            continue
        i = 1 if node.func.attr == "put_file" else 0
        if len(node.args) <= i:
            continue
        a = node.args[i]
        parts = a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a]
        if any(isinstance(e, (ast.JoinedStr, ast.BinOp)) for e in parts):
            out.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return out


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if "storage" not in p.relative_to(PKG).parts
                                        and p.name not in LAYOUT_OWNERS), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_builds_durable_keys_by_hand(path: Path) -> None:
    """Durable keys have one builder (manifest.durable_step_key and friends): nine modules used to join
    them by hand. The storage package is below keys (it maps keys to paths and objects)."""
    assert not _hand_built_keys(ast.parse(path.read_text())), path.name


def test_the_key_check_sees_a_hand_built_key() -> None:
    bad = ast.parse('tier.get_bytes(f"{prefix}/manifest.json")\ntier.delete([run + "/x"])\nos.stat(f"{a}/b")\n')
    assert len(_hand_built_keys(bad)) == 2


def _hand_built_run_paths(tree: ast.AST) -> list[str]:
    """``os.path.join`` calls that build a path in a run directory by hand: the first argument a run
    directory (``run_dir``), or a root followed by a run id (``root, run``). rundir.RunDir builds them."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and node.args):
            continue
        first = ast.unparse(node.args[0]).split(".")[-1]
        second = ast.unparse(node.args[1]).split(".")[-1] if len(node.args) > 1 else ""
        if "run_dir" in first or ("root" in first and second.startswith("run")):
            out.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return out


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.name != "rundir.py"),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_builds_run_paths_by_hand(path: Path) -> None:
    """A run's names have one owner, rundir.RunDir (seventeen joins of a root and a run id, and the file
    names of seven modules, before it): so the writer of a file and each of its readers agree on it."""
    assert not _hand_built_run_paths(ast.parse(path.read_text())), path.name


def test_the_run_path_check_sees_a_hand_built_path() -> None:
    bad = ast.parse('os.path.join(root, run_id, "events.jsonl")\nos.path.join(self.run_dir, name)\n'
                    'os.path.join(root, STATE_DIR)\nos.path.join(d, name)\n')
    assert len(_hand_built_run_paths(bad)) == 2
