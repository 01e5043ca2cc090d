"""The rslurm inspection commands over a real checkpoint directory (run as real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import clean_env, run_rslurm

from resilient_slurm import Checkpointer

pytestmark = pytest.mark.proc  # every test here starts processes (tests/check_tier.py)


def _rslurm(*args: str, root: Path) -> subprocess.CompletedProcess[str]:
    return run_rslurm(*args, "--local-dir", str(root), "--run-id", "cli")


def _make(root: Path) -> None:
    model = torch.nn.Linear(32, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with Checkpointer(local_dir=str(root), run_id="cli") as ck:
        for s in (1, 2):
            ck.save(s, {"model": model, "opt": opt, "note": f"step {s}"})


def test_ls_show_verify_json(tmp_path: Path) -> None:
    _make(tmp_path)
    ls = _rslurm("ls", "--json", root=tmp_path)
    assert ls.returncode == 0, ls.stderr
    steps = json.loads(ls.stdout)["steps"]
    assert [(s["step"], s["local"]["state"], s["reason"], s["durable"]) for s in steps] == [
        (1, "complete", "manual", None), (2, "complete", "manual", None)]
    show = _rslurm("show", "2", "--json", root=tmp_path)
    assert show.returncode == 0 and json.loads(show.stdout)["step"] == 2
    ver = _rslurm("verify", "--json", root=tmp_path)
    doc = json.loads(ver.stdout)
    assert ver.returncode == 0 and doc["ok"] and [r["step"] for r in doc["reports"]] == [1, 2]


def test_verify_names_the_corrupt_shard_and_exits_nonzero(tmp_path: Path) -> None:
    _make(tmp_path)
    shard = tmp_path / "cli" / "step_000000000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    ver = _rslurm("verify", root=tmp_path)
    assert ver.returncode == 1
    assert "CORRUPT" in ver.stdout and str(shard) in ver.stdout
    assert "OK" in ver.stdout  # step 1 is still fine
    only1 = _rslurm("verify", "1", root=tmp_path)
    assert only1.returncode == 0


def test_unknown_step_is_a_clear_error(tmp_path: Path) -> None:
    _make(tmp_path)
    r = _rslurm("show", "7", root=tmp_path)
    assert r.returncode == 2 and "step 7 not found" in r.stderr


def test_a_run_no_tier_has_is_an_error_naming_the_runs_there(tmp_path: Path) -> None:
    _make(tmp_path)
    durable = tmp_path / "typo-durable"
    for cmd in (["ls"], ["runs"], ["gc", "--dry-run"], ["verify"], ["history"]):
        r = run_rslurm(*cmd, "--local-dir", str(tmp_path), "--durable", str(durable), "--run-id", "cil")
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "no run 'cil'" in r.stderr and "the runs there: cli" in r.stderr, (cmd, r.stderr)
    assert not durable.exists()  # no inspection command makes a directory at a mistyped durable path
    # A run with a directory and no step yet (a job before its first save) is known: an empty listing.
    (tmp_path / "fresh").mkdir()
    r = run_rslurm("ls", "--local-dir", str(tmp_path), "--run-id", "fresh")
    assert r.returncode == 0 and "(no checkpoints)" in r.stdout, r.stderr


@pytest.mark.parametrize("argv", [["ls"], ["ls", "--json"], ["show", "2"], ["verify"]])
def test_a_reader_that_goes_away_ends_the_command_as_sigpipe_does(tmp_path: Path, argv: list[str]) -> None:
    """``rslurm ls | head -1``: exit 141 (128 + SIGPIPE, as a tool killed by it), nothing on stderr; not exit 1,
    which says the data has a fault."""
    _make(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "resilient_slurm.cli", *argv, "--local-dir", str(tmp_path),
                          "--run-id", "cli"], env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # gone before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(120) == 141 and err == "", err


def test_cli_and_launcher_do_not_import_torch() -> None:
    """`rslurm launch` is a small process on the batch host: it must not pay torch's import (seconds on a
    busy node) nor its memory; only `show`, `verify`, `export`, `demo` and the ranks need torch."""
    code = ("import sys, resilient_slurm.cli, resilient_slurm.launcher.launch, resilient_slurm.control; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=clean_env())


def test_ls_and_gc_do_not_import_torch(tmp_path: Path) -> None:
    """`rslurm ls` and `rslurm gc` read manifests only: they stay fast on a login node."""
    _make(tmp_path)
    code = ("import sys, io, contextlib; from resilient_slurm import cli\n"
            "for argv in (['ls', '--json'], ['gc', '--dry-run', '--json']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "        assert cli.main([*argv, '--local-dir', sys.argv[1]]) == 0\n"
            "    assert '\"step\": 2' in out.getvalue() or argv[0] == 'gc', out.getvalue()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60, env=clean_env())
