"""Per-step metrics, the post-resume check and ``rslurm rehearse``.

The rehearsals run real programs (tests/workers/rehearse_worker.py: 2 gloo ranks, DDP) under the real
``rslurm launch -n 2``, stopped by a real SIGTERM to the launcher and, with ``--kill``, a real SIGKILL
to a rank (the launcher's in-job restart then trains the steps since the checkpoint again):

- an exact program passes (exit 0), and its re-trained steps give ``resume_verified`` events;
- a nanoGPT-style prefetching loop, a program drawing from a ``random.Random`` it keeps outside
  ``state`` and a program with a per-rank counter outside ``state`` fail (exit 1), naming the first
  step after the resume and the likely cause; the re-trained steps of the unsaved RNG give a
  ``resume_diverged`` event with both values.

The events' fields are checked against docs/telemetry.md (``check_records`` of test_telemetry).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, read_jsonl, run_ranks, start_ranks
from slurm_cluster import SlurmCluster
from test_telemetry import check_records, read_docs

from resilient_slurm import ConfigError
from resilient_slurm.checkpoint.metrics import (
    MAX_METRICS,
    MetricsLog,
    ResumeCheck,
    check_metrics,
    metrics_path,
    read_metrics,
)
from resilient_slurm.rehearse import compare, likely_causes

WORKER = REPO / "tests" / "workers" / "rehearse_worker.py"


# ------------------------------------------------------------------------------------------- metrics
def test_metrics_are_numbers_and_errors_name_the_step_and_key() -> None:
    got = check_metrics(7, {"loss": torch.tensor(0.25), "lr": 3e-4, "tokens": 4096, "n": torch.tensor([2])})
    assert got == {"loss": 0.25, "lr": 3e-4, "tokens": 4096, "n": 2}
    assert isinstance(got["loss"], float)
    for bad, words in [({"loss": math.nan}, ["step 7", "'loss'", "finite"]),
                       ({"loss": torch.tensor(math.inf)}, ["'loss'", "inf"]),
                       ({"loss": torch.ones(2)}, ["'loss'", "2 elements"]),
                       ({"loss": "0.1"}, ["'loss'", "numbers"]),
                       ({"ok": True}, ["'ok'", "numbers"]),
                       ({"x" * 65: 1.0}, ["at most 64"]),
                       ({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, [f"at most {MAX_METRICS}"])]:
        with pytest.raises(ConfigError) as ei:
            check_metrics(7, bad)
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))


def test_a_resume_cuts_the_repeated_steps_off_the_file_and_returns_them(tmp_path: Path) -> None:
    log = MetricsLog(str(tmp_path), 1, 2)
    for s in range(1, 3001):  # about 100 KB: the backward read crosses chunks
        log.record(s, {"loss": s / 7, "step_sq": s * s})
    log.close()
    path = Path(metrics_path(str(tmp_path), 1))
    with open(path, "ab") as f:
        f.write(b'{"step":3001,"world":2,"m":{"lo')  # torn by a kill
    later = MetricsLog(str(tmp_path), 1, 2).resume(2990)
    assert sorted(later) == list(range(2991, 3001))
    assert later[2995].values == {"loss": 2995 / 7, "step_sq": 2995 * 2995}  # floats round-trip exactly
    kept = read_metrics(str(tmp_path))[1]
    assert sorted(kept) == list(range(1, 2991)) and path.read_bytes().endswith(b"\n")
    assert MetricsLog(str(tmp_path), 1, 2).resume(0).keys() == set(range(1, 2991))
    assert path.read_bytes() == b""
    assert MetricsLog(str(tmp_path / "none"), 0, 1).resume(5) == {}


def test_the_resume_check_compares_the_repeated_steps() -> None:
    log_records = {s: {"loss": 1.0 / s} for s in (5, 6, 7)}
    from resilient_slurm.checkpoint.metrics import Record

    before = {s: Record(s, 2, v) for s, v in log_records.items()}
    ok = ResumeCheck(4, before, 2, 0.0)
    assert [ok.observe(s, {"loss": 1.0 / s}) for s in (5, 6)] == [None, None] and not ok.finished(6)
    assert ok.observe(7, {"loss": 1.0 / 7}) is None and ok.finished(7) and ok.compared == [5, 6, 7]
    bad = ResumeCheck(4, before, 2, 0.0)
    d = bad.observe(5, {"loss": 0.2 + 1e-12})
    assert d is not None and (d.step, d.metric, d.before, d.after) == (5, "loss", 0.2, 0.2 + 1e-12)
    assert ResumeCheck(4, before, 2, 1e-9).observe(5, {"loss": 0.2 + 1e-12}) is None  # relative tolerance
    assert not ResumeCheck(4, before, 4, 0.0).pending  # recorded with 2 ranks: other data, not compared
    missing = ResumeCheck(4, before, 2, 0.0).observe(5, {})
    assert missing is not None and missing.after is None


def test_the_comparison_finds_the_first_step_and_the_ranks() -> None:
    ref = {r: {s: {"loss": float(s + r)} for s in range(1, 11)} for r in range(2)}
    assert compare(ref, ref, 0.0).identical and compare(ref, ref, 0.0).values == 20
    got = json.loads(json.dumps(ref, default=float))  # a copy
    got = {int(r): {int(s): v for s, v in steps.items()} for r, steps in got.items()}
    got[1][7] = {"loss": 99.0}
    got[1][9] = {"loss": 98.0}
    cmp = compare(ref, got, 0.0)
    assert cmp.first_step == 7 and [(d.rank, d.metric, d.uninterrupted, d.resumed) for d in cmp.differences] == \
        [(1, "loss", 8.0, 99.0)]
    causes = likely_causes(cmp, [6], 2)
    assert "per-rank state" in causes[0] and "only on rank 1" in causes[0]
    assert "not at the first step after a resume" in likely_causes(cmp, [3], 2)[0]
    assert "before any resume" in likely_causes(cmp, [8], 2)[0]
    assert any("batch fetched before ckpt.step()" in c for c in causes)
    # A program trained through an integration: the framework's loop is named, not a prefetch the integration
    # already handles.
    framework = likely_causes(cmp, [6], 2, integration="lightning")
    assert any("Lightning's loop" in c and "documented exceptions" in c for c in framework), framework
    assert not any("ckpt.step()" in c for c in framework), framework
    del got[1][10]
    assert compare(ref, {0: ref[0], 1: {**ref[1], 10: {}}}, 0.0).first_step == 10


# ------------------------------------------------------------------------------------------ rehearsals
def _rehearse(tmp_path: Path, mode: str, *extra: str, seed: int = 3) -> tuple[int, str, Path]:
    out = tmp_path / mode
    argv = [sys.executable, "-m", "resilient_slurm.cli", "rehearse", "-n", "2", "--seed", str(seed), "--steps", "24",
            "--dir", str(out), *extra, "--", sys.executable, str(WORKER), "--mode", mode]
    p = subprocess.run(argv, env=clean_env({"RSLURM_LOG_LEVEL": "WARNING"}), cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr, out


def _rank_events(out: Path, event: str) -> list[dict]:
    path = out / "interrupted" / "local" / "rehearse" / "events.jsonl"
    return [e for e in read_jsonl(path) if e.get("event") == event]


@pytest.mark.proc
def test_an_exact_program_passes_and_its_repeated_steps_are_verified(tmp_path: Path) -> None:
    code, text, out = _rehearse(tmp_path, "exact", "--kill")
    assert code == 0, text
    assert "PASS" in text and "SIGKILL to rank process" in text, text
    stopped = int(re.search(r"stopped after step (\d+)", text).group(1))  # type: ignore[union-attr]
    verified = _rank_events(out, "resume_verified")
    assert verified and not _rank_events(out, "resume_diverged"), text
    assert any(e["rank"] == 0 for e in verified)
    for e in verified:
        assert e["restored_step"] >= stopped and e["first_step"] == e["restored_step"] + 1
        assert e["steps"] == e["last_step"] - e["first_step"] + 1 and e["values"] == 2 * e["steps"]
    check_records(read_docs(), verified)
    # every rank's file holds one value per step: the run as it finally went
    final = read_metrics(str(out / "interrupted" / "local" / "rehearse"))
    assert sorted(final) == [0, 1] and all(sorted(s) == list(range(1, 25)) for s in final.values())


@pytest.mark.proc
@pytest.mark.parametrize("mode,cause", [("prefetch", "a batch fetched before ckpt.step() (on every rank"),
                                        ("rank", "per-rank state that is not in state (only on rank 1")])
def test_a_program_that_loses_state_at_a_stop_fails_at_the_first_step_after_it(tmp_path: Path, mode: str,
                                                                               cause: str) -> None:
    code, text, _ = _rehearse(tmp_path, mode)
    assert code == 1, text
    resumed = int(re.search(r"resumed from step (\d+)", text).group(1))  # type: ignore[union-attr]
    assert f"first differs from the uninterrupted run at step {resumed + 1}" in text, text
    lines = text.splitlines()
    assert lines[lines.index("likely causes:") + 1].startswith(f"  - {cause}"), text
    ranks = re.findall(r"^  rank (\d): ", text, re.M)
    assert ranks == (["0", "1"] if mode == "prefetch" else ["1"]), text


@pytest.mark.proc
def test_an_unsaved_generator_is_caught_by_the_rehearsal(tmp_path: Path) -> None:
    code, text, _ = _rehearse(tmp_path, "rng")
    assert code == 1, text
    resumed = int(re.search(r"resumed from step (\d+)", text).group(1))  # type: ignore[union-attr]
    assert f"first differs from the uninterrupted run at step {resumed + 1}" in text, text
    assert re.findall(r"^  rank (\d): ", text, re.M) == ["0", "1"], text
    assert "generator that is not in state" in text, text


@pytest.mark.proc
def test_a_crashed_run_resumed_with_an_unsaved_generator_reports_the_first_repeated_step(tmp_path: Path) -> None:
    """Without rehearse: a run that crashes after its newest checkpoint, resumed, trains the steps since that
    checkpoint again; each rank compares them with what it recorded before the crash."""
    env = {"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_RUN_ID": "crash", "RSLURM_LOG_LEVEL": "WARNING"}
    argv = [str(WORKER), "--mode", "rng", "--steps", "12", "--every-steps", "4", "--sleep", "0"]
    job = start_ranks([*argv, "--crash-after", "10"], 2, tmp_path, env)
    assert job.wait(120) == [3, 3], job.output(0)
    job = run_ranks(argv, 2, tmp_path, env=env, timeout=120)
    out = job.output(0) + job.output(1)
    run_dir = tmp_path / "nvme" / "crash"
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"].startswith("resume_")]
    assert sorted((e["event"], e["rank"]) for e in events) == [("resume_diverged", 0), ("resume_diverged", 1)], out
    check_records(read_docs(), events)
    before = read_metrics(str(run_dir))  # the run as it finally went: steps 9 and 10 as trained after the resume
    for e in events:
        assert (e["restored_step"], e["step"], e["metric"], e["tolerance"]) == (8, 9, "batch", 0)
        assert e["before"] != e["after"] == before[e["rank"]][9]["batch"]
        assert f"rank {e['rank']}: the resumed run is not exact: step 9 recorded batch={e['before']!r}" in out, out
    assert all(sorted(steps) == list(range(1, 13)) for steps in before.values())


@pytest.mark.proc
def test_usage_errors_exit_2(tmp_path: Path) -> None:
    env = clean_env()
    base = [sys.executable, "-m", "resilient_slurm.cli", "rehearse"]
    for args, words in [([], "no command"), (["--steps", "1", "--", "true"], "--steps must be >= 3"),
                        (["--tolerance", "-1", "--", "true"], "--tolerance"),
                        (["--", sys.executable, "-c", "pass"], "recorded no metrics"),
                        (["--dir", "/dev/null", "--", "true"], "--dir /dev/null is a character device, not a directory"),
                        (["--dir", str(tmp_path / "f" / "sub"), "--", "true"], "cannot make it"),
                        (["--timeout", "0", "--", "true"], "--timeout must be a number of seconds > 0"),
                        (["--timeout", "nan", "--", "true"], "--timeout must be")]:
        (tmp_path / "f").write_text("a file")
        p = subprocess.run([*base, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, (args, p.stdout, p.stderr)


@pytest.mark.proc
def test_a_rehearsal_runs_as_a_slurm_job_without_requeueing_it(slurm: SlurmCluster) -> None:
    """Inside an allocation the ranks run as local ranks of the job's node: the SIGTERM of the stop is the
    rehearsal's, and the launcher neither requeues nor holds the job the rehearsal runs in."""
    work = slurm.work_dir / "rehearse"
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    script = (f"#!/bin/bash\nexport PYTHONPATH='{REPO}' OMP_NUM_THREADS=1 RSLURM_LOG_LEVEL=WARNING "
              f"RSLURM_CONTROL_DIR='{work / 'ctl'}'\n"
              f"exec {py} -m resilient_slurm.cli rehearse -n 2 --seed 3 --steps 24 --dir '{work / 'runs'}' -- "
              f"{py} {WORKER} --mode exact\n")
    job = slurm.sbatch(script, "-p", "low", "-N1", "--requeue", "-o", str(work / "job.out"))
    info = slurm.wait_state(job, "COMPLETED", timeout=300)
    out = (work / "job.out").read_text(errors="replace")
    assert f"inside Slurm job {job}" in out and "PASS" in out, out
    assert info.get("Restarts") == "0" and info.get("ExitCode") == "0:0", info
    assert "resumed from step" in out, out
