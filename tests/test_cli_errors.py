"""Edges of the ``rslurm`` command line, run in process: how a command ends on an interruption (one line and
the shell's code, no traceback), and what the local tier's template does not take for a storage domain.
(Errors of usage, settings and data are tested with each command.)"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from resilient_slurm import cli
from resilient_slurm.catalog.inventory import local_roots


def drained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *steps: int) -> tuple[Path, Path, list[str]]:
    """Steps of run r1 saved on node n1 and drained by ``daemon --once`` into a POSIX durable tier: the local
    tier, the durable tier, and the flags that name both."""
    import torch

    from resilient_slurm import Checkpointer

    nvme, durable = tmp_path / "nvme", tmp_path / "durable"
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    with Checkpointer(local_dir=str(nvme / "%n"), run_id="r1", keep_last=5) as ck:
        for s in steps or (1,):
            ck.save(s, {"w": torch.ones(4) * s})
    flags = ["--local-dir", str(nvme / "%n"), "--durable", str(durable)]
    assert cli.main(["daemon", "--once", *flags]) == 0
    return nvme, durable, flags


@pytest.mark.parametrize("command", ["verify", "export", "doctor"])
def test_ctrl_c_ends_a_command_with_one_line_and_exit_130(command: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    # The parser takes each command's function when it is built, inside main: the stand-in is what runs.
    if command == "doctor":
        monkeypatch.setattr(cli.doctor, "cmd_doctor", interrupted)
        argv = ["doctor"]
    else:
        monkeypatch.setattr(cli, f"cmd_{command}", interrupted)
        argv = [command, "--local-dir", str(tmp_path)] + (["1", str(tmp_path / "out"), "--format", "torch"] if command == "export" else [])
    assert cli.main(argv) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert err.strip() == f"rslurm {command}: interrupted", err


def test_the_control_sockets_directory_is_not_a_storage_domain(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime directory is $XDG_RUNTIME_DIR/rslurm when that directory is the user's (else
    # /tmp/rslurm-<uid>/run, beside the default local template's domains): a template over the same
    # directory matches it, and it holds sockets, not checkpoints.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for d in ("rslurm", "n1", "n2"):
        (tmp_path / d).mkdir()
    assert local_roots(str(tmp_path / "%n"), "n1") == [str(tmp_path / "n1"), str(tmp_path / "n2")]


def test_settings_that_cannot_be_used_are_exit_2_not_a_fault_in_the_data(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "afile"
    a_file.write_text("not a directory")
    (tmp_path / "nvme" / "run1").mkdir(parents=True)
    nvme = str(tmp_path / "nvme")
    cases = [
        (["verify", "--local-dir", nvme, "--scratch-dir", str(tmp_path / "none")], "--scratch-dir"),
        (["verify", "--local-dir", nvme, "--scratch-dir", str(a_file)], "--scratch-dir"),
        (["verify", "--local-dir", str(a_file)], "is not a directory"),
        (["gc", "--dry-run", "--local-dir", str(a_file)], "is not a directory"),
        (["gc", "--local-dir", str(a_file / "below")], "is not a directory"),
        (["show", "--local-dir", nvme, "--run-id", "run2"], "no run 'run2'"),
        (["verify", "3", "--local-dir", nvme, "--run-id", "run2"], "no run 'run2'"),
        (["tag", "3", "best", "--local-dir", nvme, "--run-id", "run2"], "no run 'run2'"),
    ]
    for argv, says in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_doctor_refuses_a_signal_timeout_that_is_not_a_finite_positive_number(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", f"--signal-timeout={value}"]) == 2
    assert "--signal-timeout" in capsys.readouterr().err


def test_status_with_a_durable_tier_it_cannot_list_says_unknown_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import torch

    from resilient_slurm import Checkpointer

    nvme, not_a_dir = tmp_path / "nvme", tmp_path / "durable-file"
    not_a_dir.write_text("a file where the durable tier goes")
    with Checkpointer(local_dir=str(nvme), run_id="r1") as ck:
        ck.save(1, {"w": torch.ones(4)})
    assert cli.main(["status", "--json", "--local-dir", str(nvme), "--durable", str(not_a_dir)]) == 2
    doc = json.loads(capsys.readouterr().out)
    # Not "-" (absent) and no drain lag: with nothing known to be durable, every step's age would be its lag.
    assert [(r["step"], r["durable"]) for r in doc["steps"]] == [(1, "?")] and doc["drain_lag_s"] == {}, doc
    assert any(str(not_a_dir) in e for e in doc["unreachable"]) and set(doc["unreachable"]) <= set(doc["errors"]), doc


def test_a_run_named_link_is_named_by_every_command_that_lists_the_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    nvme = tmp_path / "nvme"
    (nvme / "real").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere" / "runA"
    (elsewhere / "step_000000000001").mkdir(parents=True)
    (nvme / "runA").symlink_to(elsewhere)
    for argv, code in ((["gc", "--dry-run", "--json"], 1), (["ls", "--json"], 2), (["runs", "--json"], 2),
                       (["verify", "--json"], 1)):
        assert cli.main([*argv, "--local-dir", str(nvme)]) == code, argv
        doc = json.loads(capsys.readouterr().out)
        assert any("runA" in e and "symbolic link" in e for e in doc["errors"]), (argv, doc["errors"])
    assert (elsewhere / "step_000000000001").is_dir()


def test_a_run_directory_that_is_a_link_is_named_by_the_commands_that_take_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """show, export and diff said "steps there: none", and tag called the run directory a "tags file"."""
    import json

    import torch

    from resilient_slurm import Checkpointer

    nvme = tmp_path / "nvme"
    monkeypatch.setenv("RSLURM_NODE_NAME", "n1")
    with Checkpointer(local_dir=str(nvme), run_id="r1") as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.ones(4) * s})
    (nvme / "r1").rename(tmp_path / "moved")
    (nvme / "r1").symlink_to(tmp_path / "moved")
    flags = ["--local-dir", str(nvme), "--run-id", "r1"]
    link = f"local tier {nvme / 'r1'}: cannot list it: a symbolic link where a run directory goes"
    for argv in (["show", "2"], ["export", "2", str(tmp_path / "out"), "--format", "torch"], ["diff", "1", "2"]):
        assert cli.main([*argv, *flags]) == 2, argv
        err = capsys.readouterr().err
        assert "steps there: none; " + link in err, (argv, err)
    assert cli.main(["tag", "2", "keep", *flags]) == 1
    err = capsys.readouterr().err
    assert f"tags file {nvme / 'r1' / 'tags.json'} cannot be read: {nvme / 'r1'} is a symlink" in err, err
    # Without --run-id: show said "no checkpoints", status "(no checkpoints)" with no error and exit 0.
    assert cli.main(["show", "--local-dir", str(nvme)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoints in" in err and link in err, err
    assert cli.main(["status", "--json", "--local-dir", str(nvme)]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert any(e.startswith(link) for e in doc["errors"]) and doc["steps"] == [], doc
    assert not (tmp_path / "out").exists() and sorted(p.name for p in (tmp_path / "moved").iterdir()) == [
        "events.jsonl", "step_000000000001", "step_000000000002"]


def test_json_gets_one_document_on_stdout_also_when_a_command_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """show, diff, export and tag printed nothing on stdout when they failed: a script reading --json got no
    document. Now it gets {"ok": false, ...} with the exit code, and the message stays on stderr."""
    import json

    nvme, durable, flags = drained(tmp_path, monkeypatch, 1, 2)
    capsys.readouterr()
    run = ["--run-id", "r1"]
    for argv in (["show", "7"], ["diff", "1", "7"], ["export", "7", str(tmp_path / "o"), "--format", "torch"],
                 ["tag", "7", "best"]):
        assert cli.main([*argv, *flags, *run, "--json"]) == 2, argv
        out, err = capsys.readouterr()
        doc = json.loads(out)
        assert doc["ok"] is False and doc["command"] == argv[0] and doc["exit_code"] == 2, doc
        assert "step 7 not found" in doc["error"] and doc["error"] in err, (doc, err)
    manifest = nvme / "n1" / "r1" / "step_000000000002" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["provenance"]["config"], m["provenance"]["config_sha256"] = {"lr": 1}, "ab" * 32
    manifest.write_text(json.dumps(m))
    assert cli.main(["export", "2", str(tmp_path / "o"), "--format", "torch", "--tier", "local", *flags, *run,
                     "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 1 and "config_sha256" in doc["error"] and not (tmp_path / "o").exists(), doc
    assert cli.main(["show", "7", *flags, *run]) == 2
    assert capsys.readouterr().out == ""  # without --json, nothing on stdout


def test_verify_names_a_local_copy_that_is_wrong_when_the_durable_copy_is_sound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    nvme, durable, flags = drained(tmp_path, monkeypatch)
    capsys.readouterr()
    manifest = nvme / "n1" / "r1" / "step_000000000001" / "manifest.json"
    manifest.write_text("not json")
    for argv in (["verify"], ["verify", "1"]):
        assert cli.main([*argv, "--json", *flags]) == 1, argv
        doc = json.loads(capsys.readouterr().out)
        assert {r["tier"]: r["ok"] for r in doc["reports"]} == {"durable": True, "local": False}, doc


def test_verify_names_a_step_named_link_and_never_reads_through_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import torch

    from resilient_slurm import Checkpointer

    nvme = tmp_path / "nvme"
    with Checkpointer(local_dir=str(nvme), run_id="r1", keep_last=5) as ck:
        ck.save(1, {"w": torch.ones(4)})
    run = nvme / "r1"
    (run / "step_000000000050").symlink_to(run / "step_000000000001")
    assert cli.main(["verify", "--json", "--local-dir", str(nvme)]) == 1
    doc = json.loads(capsys.readouterr().out)
    link = [r for r in doc["reports"] if r["where"].endswith("step_000000000050")]
    assert len(link) == 1 and not link[0]["ok"] and link[0]["bytes_checked"] == 0, doc
    assert "symbolic link" in json.dumps(link[0]) and [r["step"] for r in doc["reports"] if r["ok"]] == [1], doc


@pytest.mark.parametrize("command", ["status", "history", "report"])
def test_every_command_that_reads_the_durable_tier_takes_its_connection_flags(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r1").mkdir()
    argv = [command, "--local-dir", str(tmp_path), "--run-id", "r1"]
    assert cli.main([*argv, "--s3-max-attempts", "many"]) == 2  # parsed and checked like RSLURM_S3_MAX_ATTEMPTS
    assert "--s3-max-attempts='many'" in capsys.readouterr().err
    assert cli.main([*argv, "--s3-max-attempts", "2", "--s3-region", "eu-west-1",
                     "--s3-endpoint-url", "http://127.0.0.1:9"]) == 0


def test_a_typed_run_id_is_looked_for_itself_and_an_environment_one_may_not_exist_yet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    nvme = tmp_path / "nvme"
    (nvme / "real").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (nvme / "current").symlink_to(tmp_path / "elsewhere")  # another run's problem, not real's
    local = ["--local-dir", str(nvme)]
    assert cli.main(["gc", "--dry-run", "--json", "--run-id", "real", *local]) == 0
    assert json.loads(capsys.readouterr().out)["errors"] == []
    assert cli.main(["ls", "--json", "--run-id", "real", *local]) == 0
    capsys.readouterr()
    assert cli.main(["ls", "--run-id", "typo", *local]) == 2  # the link elsewhere does not hide a misspelt id
    assert "no run 'typo'" in capsys.readouterr().err
    for argv in (["status"], ["history"], ["verify"], ["runs"]):
        assert cli.main([*argv, "--run-id", "typo", *local]) == 2, argv
        assert "no run 'typo'" in capsys.readouterr().err, argv
    # RSLURM_RUN_ID (a job's environment names its run before the first save): nothing listed, exit 0.
    monkeypatch.setenv("RSLURM_RUN_ID", "first-job")
    for argv in (["ls"], ["gc", "--dry-run"], ["history"], ["status"]):
        assert cli.main([*argv, *local]) == 0, argv
    capsys.readouterr()
    # verify of one tier fails only on what that tier could not list.
    monkeypatch.delenv("RSLURM_RUN_ID")
    durable = tmp_path / "durable"
    durable.mkdir()
    assert cli.main(["verify", "--json", "--tier", "durable", "--durable", str(durable), *local]) == 1
    assert json.loads(capsys.readouterr().out)["errors"] == []  # (exit 1: nothing verified)


def test_a_local_root_that_cannot_be_listed_is_named_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    nvme = tmp_path / "nvme"
    (nvme / "r1").mkdir(parents=True)
    real_scandir = os.scandir

    def refusing(path: object = ".") -> object:
        if os.fspath(path) == str(nvme):  # type: ignore[call-overload]
            raise PermissionError(13, "Permission denied", str(nvme))
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", refusing)
    for argv, code in ((["status"], 2), (["history"], 2), (["report"], 2)):
        assert cli.main([*argv, "--local-dir", str(nvme)]) == code, argv
        err = capsys.readouterr()
        assert "cannot list it" in err.out + err.err and "Traceback" not in err.err, (argv, err)


def test_a_local_directory_given_one_level_above_the_nodes_roots_names_them_and_lists_no_node_as_a_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--local-dir /nvme`` where the roots are ``/nvme/%n``: each node's root (it holds ``.rslurm/``) was listed as
    an empty run, and ``ls`` said "(no checkpoints)" with exit 0."""
    import json

    import torch

    from resilient_slurm import Checkpointer

    nvme = tmp_path / "nvme"
    for node in ("n1", "n2"):
        monkeypatch.setenv("RSLURM_NODE_NAME", node)
        with Checkpointer(local_dir=str(nvme / "%n"), run_id="r1") as ck:
            ck.save(1, {"w": torch.ones(4)})
        assert (nvme / node / ".rslurm").is_dir()
    for argv, code in ((["ls", "--json"], 2), (["runs", "--json"], 2), (["gc", "--dry-run", "--json"], 1),
                       (["verify", "--json"], 1)):
        assert cli.main([*argv, "--local-dir", str(nvme)]) == code, argv
        doc = json.loads(capsys.readouterr().out)
        named = [e for e in doc["errors"] if "end it with /%n" in e]
        assert {e.split(":")[0] for e in named} == {f"local tier {nvme / n}" for n in ("n1", "n2")}, (argv, doc)
        assert "n1" not in json.dumps(doc.get("runs", doc.get("steps", []))), (argv, doc)
    for argv in (["history"], ["report"], ["status"]):
        assert cli.main([*argv, "--local-dir", str(nvme)]) == 2, argv
        got = capsys.readouterr()
        assert "end it with /%n" in got.out + got.err, argv
    # The roots themselves: the run and its step, which nothing above touched.
    assert cli.main(["ls", "--json", "--local-dir", str(nvme / "%n")]) == 0
    assert [(s["run_id"], s["step"]) for s in json.loads(capsys.readouterr().out)["steps"]] == [("r1", 1)]
    assert all((nvme / n / "r1" / "step_000000000001" / "manifest.json").is_file() for n in ("n1", "n2"))


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_doctor_reads_a_batch_script_only_from_a_regular_file_of_bounded_size(
        special: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--script`` is read as ``--config`` is: a FIFO hung ``doctor`` for good, ``/dev/zero`` filled the memory."""
    import os
    import threading

    script = special
    if special == "fifo":
        script = str(tmp_path / "job.sh")
        os.mkfifo(script)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(cli.main(["doctor", "--script", script])), daemon=True)
    t.start()
    t.join(60)
    assert got == [2], got
    err = capsys.readouterr().err
    assert "not a regular file: give --script the path of a regular file" in err and "remove it" not in err, err


@pytest.mark.parametrize("damage", ["steps-not-a-list", "empty-entry", "number-entry", "waiting-for-a-number",
                                    "state-a-list"])
def test_status_leaves_out_and_names_a_damaged_entry_of_the_daemons_status_file(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of these made ``rslurm status`` end in a traceback (TypeError, KeyError)."""
    import json

    nvme, durable, flags = drained(tmp_path, monkeypatch)
    capsys.readouterr()
    assert cli.main(["status", "--json", *flags]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"] == [] and [(r["step"], r["drain"]) for r in doc["steps"]] == [(1, "durable")], doc
    status = nvme / "n1" / ".rslurm" / "daemon.json"
    d = json.loads(status.read_text())
    {"steps-not-a-list": lambda: d.update(steps="x"), "empty-entry": lambda: d.update(steps=[{}]),
     "number-entry": lambda: d.update(steps=[1]),
     "waiting-for-a-number": lambda: d["steps"][0].update(waiting_for=5),
     "state-a-list": lambda: d["steps"][0].update(state=[1])}[damage]()
    status.write_text(json.dumps(d))
    for argv in (["status", "--json"], ["status"]):
        assert cli.main([*argv, *flags]) == 0, argv
        out = capsys.readouterr().out
        assert "Traceback" not in out and f"daemon status {status}" in out, (argv, out)


@pytest.mark.parametrize("shards", ["none", "renamed"])
def test_show_of_a_step_whose_metadata_names_a_file_its_manifest_does_not_list_ends_without_a_traceback(
        shards: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``show`` ended in a KeyError (catalog/source.py) where ``verify`` names the file."""
    import json

    import torch

    from resilient_slurm import Checkpointer, ResumableSampler

    nvme = tmp_path / "nvme"
    with Checkpointer(local_dir=str(nvme), run_id="r1") as ck:  # show reads the sampler's position from the shard
        ck.save(1, {"w": torch.ones(4), "sampler": ResumableSampler(10, num_replicas=1, rank=0)})
    manifest = nvme / "r1" / "step_000000000001" / "manifest.json"
    m = json.loads(manifest.read_text())
    if shards == "none":
        m["shards"] = []
    else:
        m["shards"][0]["path"] = "__9_0.distcp"
    manifest.write_text(json.dumps(m))
    for argv in (["show", "1"], ["show", "1", "--json"]):
        code = cli.main([*argv, "--local-dir", str(nvme), "--run-id", "r1"])
        got = capsys.readouterr()
        assert code in (0, 1) and "Traceback" not in got.err, (argv, code, got.err)
    assert cli.main(["verify", "1", "--local-dir", str(nvme), "--run-id", "r1"]) == 1
    assert "__0_0.distcp" in capsys.readouterr().out


@pytest.mark.parametrize("flock", [True, False], ids=["with-flock", "no-flock"])
def test_a_tag_another_command_wrote_meanwhile_in_the_durable_copy_is_kept(
        flock: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``rslurm tag`` at once: each read the durable copy, merged its change and wrote it back, so the later
    write dropped the earlier tag (both exited 0, and gc then deleted the step meant to be kept). Now the durable
    copy is updated in one read-modify-write of the tier (StorageTier.update_bytes: a lock on POSIX, a
    conditional write on S3, tests/test_tiers.py), and the other command's tag, written between this one's read
    and its write, is merged. Where the filesystem has no flock, the copy is read again after a pause and this
    one's tag written again when another command's write dropped it."""
    from resilient_slurm import tags as tags_mod
    from resilient_slurm.catalog import tags as catalog_tags
    from resilient_slurm.storage.posix import PosixTier
    from resilient_slurm.storage.tier import StorageTier

    nvme, durable, flags = drained(tmp_path, monkeypatch, 1, 2)
    key = "r1/" + tags_mod.TAGS_FILE
    real_put, raced = PosixTier.put_bytes, []

    def other_command(tier: PosixTier) -> None:
        """Another ``rslurm tag 2 keepB`` that read the copy before this one wrote (an empty copy)."""
        raced.append(True)
        real_put(tier, key, tags_mod.empty("r1").tagged("keepB", 2).to_json())

    if flock:
        real_update = PosixTier.update_bytes

        def update_bytes(self: PosixTier, k: str, change: Any, **kw: Any) -> bool:
            if k == key and not raced:
                other_command(self)  # after this command read the copies, before its update: it must merge
            return real_update(self, k, change, **kw)  # type: ignore[no-any-return]

        monkeypatch.setattr(PosixTier, "update_bytes", update_bytes)
        monkeypatch.setattr(catalog_tags.time, "sleep", lambda s: pytest.fail("paused although the update was locked"))
    else:
        monkeypatch.setattr(PosixTier, "update_bytes", StorageTier.update_bytes)  # a filesystem without flock

        def put_bytes(self: PosixTier, k: str, data: bytes) -> None:
            real_put(self, k, data)
            if k == key and not raced:
                other_command(self)  # its write, of the copy it read before ours, lands right after ours

        monkeypatch.setattr(PosixTier, "put_bytes", put_bytes)
    assert cli.main(["tag", "1", "keepA", "--tier", "durable", *flags]) == 0, capsys.readouterr().err
    copy = tags_mod.RunTags.parse((durable / key).read_bytes(), source="test", run_id="r1")
    assert raced and copy.tags == {"keepA": 1, "keepB": 2}


@pytest.mark.parametrize("what", ["fifo", "socket", "fifo-config"])
def test_export_force_never_replaces_a_fifo_a_socket_or_a_device(
        what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--force renamed the export over whatever OUT was: run as root, `export 1 /dev/null --force` made /dev/null a
    regular file. An OUT (or the config file beside it) that is a device, a FIFO or a socket is refused, exit 2,
    and left as it is. (A device is not made here: on code without the check the test would replace it.)"""
    import os
    import socket
    import stat

    nvme, durable, flags = drained(tmp_path, monkeypatch)
    capsys.readouterr()
    out = tmp_path / "weights.pt"
    special = tmp_path / "weights.config.json" if what == "fifo-config" else out
    held = None
    if what == "socket":
        held = socket.socket(socket.AF_UNIX)
        held.bind(str(special))
    else:
        os.mkfifo(special)
    try:
        assert cli.main(["export", "1", str(out), "--format", "torch", "--force", *flags, "--run-id", "r1"]) == 2
        err = capsys.readouterr().err
        assert f"{special} is a {'socket' if what == 'socket' else 'FIFO (named pipe)'}" in err, err
        mode = os.lstat(special).st_mode
        assert stat.S_ISSOCK(mode) if what == "socket" else stat.S_ISFIFO(mode)
        assert what != "fifo-config" or not out.exists()
    finally:
        if held is not None:
            held.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["fifo", "directory", "symlink"])
def test_show_diff_and_export_name_a_metadata_or_shard_that_is_not_a_regular_file(
        what: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's .metadata that is a FIFO hung show, diff and export for good (a plain open), one that is a
    directory ended in a traceback, a link was followed; a shard that is one of these made export --format dcp
    exit 2 (torch: 1). Each is damage in the step, named as verify names it: exit 1."""
    import os

    nvme, durable, flags = drained(tmp_path, monkeypatch, 1, 2)
    capsys.readouterr()
    flags += ["--run-id", "r1"]
    step = nvme / "n1" / "r1" / "step_000000000002"

    def damage(name: str) -> None:
        target = step / name
        keep = tmp_path / f"kept-{name}"
        target.rename(keep)
        if what == "fifo":
            os.mkfifo(target)
        elif what == "directory":
            target.mkdir()
        else:
            target.symlink_to(keep)  # the same bytes, through a link: still not read
    kinds = {"fifo": "is a FIFO (named pipe)", "directory": "is a directory", "symlink": "is a symlink"}
    damage(".metadata")
    for argv in (["show", "2"], ["diff", "1", "2"], ["export", "2", str(tmp_path / "o.pt"), "--format", "torch"],
                 ["export", "2", str(tmp_path / "o"), "--format", "dcp"]):
        assert cli.main([*argv, "--tier", "local", *flags]) == 1, argv
        err = capsys.readouterr().err
        assert f"{step / '.metadata'} {kinds[what]}" in err and "Traceback" not in err, (argv, err)
    (step / ".metadata").unlink() if what != "directory" else (step / ".metadata").rmdir()
    (tmp_path / "kept-.metadata").rename(step / ".metadata")
    damage("__0_0.distcp")
    assert cli.main(["export", "2", str(tmp_path / "o"), "--format", "dcp", "--tier", "local", *flags]) == 1
    err = capsys.readouterr().err
    assert f"{step / '__0_0.distcp'} {kinds[what]}" in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("run", ["..", "../x", "/etc", "a/b", ".hidden"])
def test_diff_checks_the_run_of_a_run_step_argument_before_reading_anything(
        run: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``diff ../x:1`` joined the run into a path: it listed the parent of the local root (or /etc) and opened
    the step files of a copy planted beside the root. The RUN of ``RUN:STEP`` gets the one identifier check,
    exit 2, as ``--run-id`` does; and the catalog refuses such a run for every caller."""
    import shutil

    from resilient_slurm.catalog import Catalog
    from resilient_slurm.errors import ConfigError

    nvme, durable, flags = drained(tmp_path, monkeypatch)
    shutil.copytree(nvme / "n1" / "r1" / "step_000000000001", nvme / "x" / "step_000000000001")
    capsys.readouterr()
    for tier in ("local", "auto"):
        with pytest.raises(SystemExit) as exited:  # a usage error, from the parser
            cli.main(["diff", f"{run}:1", "r1:1", "--tier", tier, *flags])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "a run id holds letters" in err or "a run id has 1 to" in err, err
        assert "not found" not in err and "manifest" not in err, err
    with Catalog(str(nvme / "%n"), "n1") as catalog, pytest.raises(ConfigError, match="a run id"):
        catalog.resolve_run(run)


def test_verify_checks_the_recorded_config_against_its_sha256_as_export_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest whose provenance config was altered after the save: export refused it, verify said OK."""
    import json

    nvme, durable, flags = drained(tmp_path, monkeypatch)
    flags += ["--run-id", "r1"]
    assert cli.main(["verify", "1", "--tier", "all", *flags]) == 0
    capsys.readouterr()
    for tier, manifest in (("local", nvme / "n1" / "r1" / "step_000000000001" / "manifest.json"),
                           ("durable", durable / "r1" / "step_000000000001" / "manifest.json")):
        m = json.loads(manifest.read_text())
        m["provenance"]["config"], m["provenance"]["config_sha256"] = {"lr": 1}, "ab" * 32
        manifest.write_text(json.dumps(m))
        assert cli.main(["verify", "1", "--tier", tier, "--json", *flags]) == 1, tier
        doc = json.loads(capsys.readouterr().out)
        problems = [f["problem"] for r in doc["reports"] for f in r["faults"]]
        assert any("does not match its config_sha256" in p for p in problems), (tier, doc)


def test_status_shows_a_local_copy_whose_manifest_is_damaged_as_invalid_not_absent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It showed ``-`` (absent) beside the durable copy, and without a durable tier left the step out."""
    import json

    nvme, durable, flags = drained(tmp_path, monkeypatch, 1, 2)
    manifest = nvme / "n1" / "r1" / "step_000000000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    capsys.readouterr()
    for argv, durable_state in ((flags, "durable"), (flags[:2], "-")):
        assert cli.main(["status", "--json", *argv]) == 0
        doc = json.loads(capsys.readouterr().out)
        rows = {r["step"]: (r["local"], r["durable"]) for r in doc["steps"]}
        assert rows == {1: ("committed", durable_state), 2: ("invalid", durable_state)}, doc
        assert any(str(manifest) in e for e in doc["errors"]), doc["errors"]
