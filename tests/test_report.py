"""``rslurm report``: a run's timeline and goodput from its event log and history (docs/cli.md).

The end-to-end test makes a real local run with an in-job restart (a rank SIGKILLed) and a preemption
(SIGTERM to the launcher, then the same command again, which resumes), and checks every number of
``rslurm report --json`` against what it recomputes itself from ``events.jsonl`` and the history. The unit
tests build event lists by hand: a node lost and a restore from the durable tier (or a partner), and
partial data (only rank events, no history, a torn last line).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import clean_env, read_jsonl, run_rslurm

from resilient_slurm import cli
from resilient_slurm.catalog.history import RunHistory
from resilient_slurm.catalog.report import CAUSES, build_report, read_events, report_run
from resilient_slurm.run_history import Incarnation, ProgressHistory

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- hand-made events
def ev(t: float, event: str, source: str = "rank", **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "source": source, "node": "n1", "run_id": "toy", **fields}


def save(t: float, step: int, stall: float, rank: int, reason: str = "interval") -> list[dict[str, Any]]:
    return [ev(t, "save_staged", rank=rank, step=step, reason=reason, stall_s=stall),
            ev(t + 0.1, "save_committed", rank=rank, step=step, reason=reason, total_s=0.2)]


def node_loss_events(tier: str) -> list[dict[str, Any]]:
    """Incarnation 0 (job 7): starts at 100, trains from scratch, saves 10 and 20; its node is lost at 140
    (step 20 committed but never drained). Incarnation 1 starts at 160 on another node, restores step 10
    from ``tier`` and completes at 195 with step 20 saved again."""
    recs = [ev(100, "start", "launcher", restart_count=0, baseline_step=None)]
    recs += [ev(110, "restore_none", rank=r, seconds=1.0) for r in (0, 1)]
    recs += save(120, 10, 0.5, 0) + save(120, 10, 0.3, 1) + save(130, 20, 0.5, 0) + save(130, 20, 0.4, 1)
    recs += [ev(121, "drain_started", "daemon", step=10), ev(123, "drained", "daemon", step=10, seconds=2.0,
                                                                  bytes=100, state="durable"),
             ev(123, "drain_lag", "daemon", seconds=3.0)]
    recs += [ev(140, "decision", "launcher", outcome="node_failure", committed_step=20, evidence="node n1 lost")]
    recs += [ev(160, "start", "launcher", restart_count=1, baseline_step=10)]
    recs += [ev(175, "restore", rank=r, step=10, tier=tier, seconds=5.0, fetched_bytes=100) for r in (0, 1)]
    recs += save(185, 20, 0.5, 0) + save(185, 20, 0.5, 1)
    recs += [ev(195, "decision", "launcher", outcome="completed", committed_step=20, evidence="")]
    return sorted(recs, key=lambda r: r["t"])


@pytest.mark.parametrize("tier", ["durable", "peer"])
def test_node_loss_and_a_restore_from_another_tier(tmp_path: Path, tier: str) -> None:
    doc = build_report(str(tmp_path / "toy"), node_loss_events(tier), None).to_json()
    assert doc["wall_s"] == pytest.approx(95.0)
    # restore_none at 110 took 1 s: 9 s of startup; the new incarnation 175 - 5 - 160 = 10 s
    expected = {"startup": 19.0, "restore": 6.0, "waiting": 20.0, "save_stall": 1.5,
                # steps 11..20 (from the save of 10 at 120 to the loss at 140, less 20's stall) are lost
                "recomputed": 19.5,
                "other": 10.0}  # from the last step (185) to the end (195)
    assert doc["losses_s"] == pytest.approx(expected)
    assert doc["kept_s"] == pytest.approx(9.5 + 9.5)
    assert doc["kept_s"] + sum(doc["losses_s"].values()) == pytest.approx(doc["wall_s"])
    assert doc["goodput"] == pytest.approx(19.0 / 95.0)
    i0, i1 = doc["incarnations"]
    assert (i0["end_reason"], i0["restored_step"], i0["committed_step"]) == ("node_failure", None, 20)
    assert (i1["end_reason"], i1["restored_step"], i1["committed_step"]) == ("completed", 10, 20)
    assert i1["runs_of_ranks"][0]["restore_tiers"] == [tier]
    # 10 steps past step 10 were seen (the save of 20), ~10 more at 0.95 s a step before the loss at 140
    assert i0["steps_recomputed"] == 20
    assert doc["drains"] == [{"step": 10, "start": 121, "end": 123, "seconds": 2.0, "bytes": 100,
                              "state": "durable"}]
    assert doc["drain_lag_max_s"] == 3.0
    assert any("no history" in m for m in doc["missing"])


def test_partial_data_only_rank_events_no_history_and_a_torn_last_line(tmp_path: Path) -> None:
    run = tmp_path / "nvme" / "toy"
    run.mkdir(parents=True)
    recs = [r for r in node_loss_events("local") if r["source"] == "rank"]
    lines = [json.dumps(r) for r in recs] + ["not json", '{"t": 1, "no": "event"}']
    (run / "events.jsonl").write_text("\n".join(lines) + "\n" + '{"t": 199, "event": "save_st')
    log = read_events(str(run / "events.jsonl"))
    assert len(log.records) == len(recs)
    assert any("last line is incomplete" in p for p in log.problems)
    assert any("2 line(s) are not event records" in p for p in log.problems)
    doc = report_run(str(tmp_path / "nvme"), "toy", RunHistory("toy", ProgressHistory(), None)).to_json()
    assert [i["restored_step"] for i in doc["incarnations"]] == [None, 10]
    assert doc["wall_start_from"] == "ranks' restore events"
    assert doc["kept_s"] + sum(doc["losses_s"].values()) == pytest.approx(doc["wall_s"])
    assert doc["wall_s"] == pytest.approx(185.1 - 109.0)  # the first restore's start to the last rank event
    missing = " ".join(doc["missing"])
    assert "no launcher events and no history" in missing and "no history" in missing
    # Nothing at all: no crash, and it says so.
    empty = report_run(str(tmp_path / "nvme"), "other", None).to_json()
    assert empty["goodput"] is None and empty["incarnations"] == []
    assert any("no event log" in m for m in empty["missing"])


def test_the_history_places_the_incarnations_without_launcher_events(tmp_path: Path) -> None:
    recs = [r for r in node_loss_events("durable") if r["source"] == "rank"]
    hist = ProgressHistory((Incarnation(0, "node_failure", None, 20, job_id="7", started_at=100, ended_at=140),
                            Incarnation(1, "completed", 10, 20, job_id="7", started_at=160, ended_at=195)))
    doc = build_report(str(tmp_path / "toy"), recs, RunHistory("toy", hist, "h.json")).to_json()
    assert [i["end_reason"] for i in doc["incarnations"]] == ["node_failure", "completed"]
    assert doc["wall_s"] == pytest.approx(95.0)
    assert doc["losses_s"]["recomputed"] == pytest.approx(19.5)
    assert doc["losses_s"]["waiting"] == pytest.approx(20.0)


def test_a_run_that_does_not_exist_exits_2_naming_its_directory(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "nvme").mkdir()
    assert cli.main(["report", "--local-dir", str(tmp_path / "nvme"), "nope"]) == 2
    err = capsys.readouterr().err
    assert "rslurm: error:" in err and str(tmp_path / "nvme" / "nope") in err


def test_the_picture_never_replaces_a_file_of_a_tier_or_one_that_is_not_a_picture(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nvme, durable = tmp_path / "nvme", tmp_path / "durable"
    manifest = nvme / "run1" / "step_000000000001" / "manifest.json"
    kept = durable / "run1" / "tags.json"
    notes = tmp_path / "notes.txt"
    for f, body in ((manifest, b'{"step": 1}'), (kept, b"{}"), (notes, b"mine")):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(body)
    for out, says in ((manifest, "is inside the local tier"), (kept, "is inside the durable tier"),
                      (nvme, "is inside the local tier"), (tmp_path, "holds the local tier"),
                      (notes, "is not a PNG picture")):
        argv = ["report", "--local-dir", str(nvme), "--durable", str(durable), "run1", "--out", str(out)]
        assert cli.main(argv) == 2, out
        err = capsys.readouterr().err
        assert says in err and str(out) in err, err
    assert manifest.read_bytes() == b'{"step": 1}' and kept.read_bytes() == b"{}" and notes.read_bytes() == b"mine"
    assert cli.main(["report", "--local-dir", str(nvme), "run1", "--out", ""]) == 2  # not the current directory
    assert "--out is empty" in capsys.readouterr().err


# --------------------------------------------------------------------------- a real run
TOY = ["-m", "resilient_slurm.examples.train_toy", "--steps", "30", "--every-steps", "5", "--workers", "0",
       "--step-sleep", "0.05"]


def _last_step(log: Path) -> int:
    return max((e["step"] for e in read_jsonl(log) if "loss" in e), default=-1) if log.exists() else -1


def _starts(log: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(log) if e.get("event") == "start"] if log.exists() else []


def _wait(cond: Any, what: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _launch(tmp: Path, env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "resilient_slurm.cli", "launch", "-n", "2", "--", sys.executable, *TOY,
           "--log", str(tmp / "log.%r.jsonl")]
    with open(tmp / f"{name}.err", "wb") as err:
        return subprocess.Popen(cmd, env=env, cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True)


def _expected(run_dir: Path) -> dict[str, Any]:
    """The report's numbers recomputed from events.jsonl and the history of this test's run: runs A (killed),
    B (after the in-job restart, preempted) and C (the relaunch, completed)."""
    recs = read_jsonl(run_dir / "events.jsonl")
    hist = json.loads((run_dir / "launcher-history.json").read_text())["incarnations"]
    starts = [r["t"] for r in recs if r["event"] == "start"]
    (ij,) = [r for r in recs if r["event"] == "in_job_restart"]
    wall_end = max([r["t"] for r in recs if r["source"] in ("rank", "launcher")] + [h["ended_at"] for h in hist])
    bounds = [(starts[0], ij["t"]), (ij["t"] + ij["backoff_s"], hist[0]["ended_at"]), (starts[1], wall_end)]
    out = {c: 0.0 for c in CAUSES} | {"kept": 0.0}
    out["waiting"] = ij["backoff_s"] + starts[1] - hist[0]["ended_at"]
    runs = []
    for a, b in bounds:
        mine = [r for r in recs if r["source"] == "rank" and a <= r["t"] <= b]
        restore = max((r for r in mine if r["event"] in ("restore", "restore_none")), key=lambda r: r["t"])
        saves: dict[tuple[int, str], tuple[float, float]] = {}
        for r in mine:
            if r["event"] == "save_staged":
                k = (r["step"], r["reason"])
                saves[k] = (r["t"], max(r["stall_s"], saves.get(k, (0, 0))[1]))
        runs.append({"start": a, "end": b, "train_start": restore["t"], "restore": restore["seconds"],
                     "restored": restore.get("step"), "saves": saves})
        out["startup"] += restore["t"] - restore["seconds"] - a
        out["restore"] += restore["seconds"]
        out["save_stall"] += sum(s for _, s in saves.values())
    A, B, C = runs
    mark = {step: t for (step, _), (t, _) in A["saves"].items()}
    kept_until = mark[B["restored"]]  # run A's steps up to the one B restored were kept, the rest trained again
    out["kept"] += kept_until - A["train_start"] - sum(s for t, s in A["saves"].values() if t <= kept_until)
    out["recomputed"] += A["end"] - kept_until - sum(s for t, s in A["saves"].values() if t > kept_until)
    for run, last in ((B, C["restored"]), (C, hist[1]["committed_step"])):
        end = max(t for (step, _), (t, _) in run["saves"].items() if step == last)
        out["kept"] += end - run["train_start"] - sum(s for _, s in run["saves"].values())
    out["wall"] = wall_end - starts[0]
    out["other"] = out["wall"] - sum(v for k, v in out.items() if k not in ("other", "wall"))
    return out


@pytest.mark.proc
def test_report_of_a_real_run_with_an_in_job_restart_and_a_preemption(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    env = clean_env({"RSLURM_LOCAL_DIR": str(nvme), "RSLURM_RUN_ID": "toy"})
    log1 = tmp_path / "log.1.jsonl"
    first = _launch(tmp_path, env, "first")
    _wait(lambda: _last_step(log1) >= 7, "rank 1 to reach step 7", first)
    os.kill(_starts(log1)[-1]["pid"], signal.SIGKILL)
    _wait(lambda: len(_starts(log1)) >= 2 and _last_step(log1) >= 16, "the restarted ranks to reach step 16",
          first)
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 75, (tmp_path / "first.err").read_text()[-3000:]
    again = _launch(tmp_path, env, "again")
    assert again.wait(180) == 0, (tmp_path / "again.err").read_text()[-3000:]

    png = tmp_path / "run.png"
    r = run_rslurm("report", "--json", "--out", str(png), env={"RSLURM_LOCAL_DIR": str(nvme)})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    incs = doc["incarnations"]
    assert len(incs) == 2
    assert [[s["end_reason"] for s in i["runs_of_ranks"]] for i in incs] == [["killed_by_signal", "preempted"],
                                                                             ["completed"]]
    restored = [[s["restored_step"] for s in i["runs_of_ranks"]] for i in incs]
    hist = json.loads((nvme / "toy" / "launcher-history.json").read_text())["incarnations"]
    assert restored == [[None, hist[0]["in_job"][0]["committed_step"]], [hist[0]["committed_step"]]]
    assert incs[1]["committed_step"] == 30
    exp = _expected(nvme / "toy")
    assert doc["wall_s"] == pytest.approx(exp["wall"], abs=1e-6)
    assert doc["kept_s"] == pytest.approx(exp["kept"], abs=1e-6)
    for cause in CAUSES:
        assert doc["losses_s"][cause] == pytest.approx(exp[cause], abs=1e-6), cause
    assert doc["goodput"] == pytest.approx(exp["kept"] / exp["wall"], abs=1e-6)  # times ~1.8e9 s: 1e-7 s apart
    assert doc["kept_s"] + sum(doc["losses_s"].values()) == pytest.approx(doc["wall_s"], abs=1e-6)
    assert doc["losses_s"]["recomputed"] > 0 and doc["losses_s"]["waiting"] >= 2.0  # the in-job backoff
    # Steps trained again: from the step run B restored to the furthest step run A began (the launcher's last
    # reading of the heartbeats: exact, the killed rank's record stays).
    exited = [r for r in read_jsonl(nvme / "toy" / "events.jsonl") if r["event"] == "ranks_exited"]
    # (A rank that ends on its own removes its record: the completed run's last reading may be a second behind, or
    # none at all when the launcher read no heartbeat of that run before its ranks ended: null, as docs/telemetry.md
    # says. A clean-clone CI run met that once, on a loaded machine.)
    last = exited[-1]["last_step"]
    assert exited[0]["last_step"] >= 7 and (last is None or 0 < last <= 30), exited
    assert incs[0]["runs_of_ranks"][0]["steps_recomputed"] == exited[0]["last_step"] - restored[0][1] > 0
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    text = run_rslurm("report", "toy", env={"RSLURM_LOCAL_DIR": str(nvme)})
    assert text.returncode == 0 and "goodput" in text.stdout and "killed by signal" in text.stdout


def test_an_event_log_that_is_a_fifo_or_a_link_is_named_and_not_read(tmp_path: Path) -> None:
    """A FIFO planted as events.jsonl would block a plain open; a link would be read through: both are
    reported as unreadable at once."""
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "real.jsonl").write_text('{"t": 1.0, "event": "start"}\n')
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    for path in (fifo, tmp_path / "link.jsonl"):
        log = read_events(str(path))
        assert not log.found and log.records == [] and any(str(path) in p for p in log.problems), log.problems
