"""Telemetry end to end: the run's event log and the daemon's Prometheus textfile say what docs/telemetry.md
says, with values that match the checkpoints on disk.

The tables of docs/telemetry.md are parsed (events per writer with their fields, common fields, metrics
with type and labels) and checked against what real runs wrote, so the page and the code cannot drift:
every documented event and metric appears, with exactly the documented fields and labels, and nothing
undocumented does.

The local scenario (one module fixture, real processes throughout):

1. ``rslurm launch -n 2`` trains ``resilient_slurm.examples.train_toy`` (DDP over gloo) with a POSIX
   durable tier and a metrics textfile: the launcher runs its own drain daemon. SIGTERM to the launcher
   at step 18 or later: emergency save, drained, launcher exits 75.
2. ``rslurm daemon --once`` to S3 (moto over HTTP) with a bandwidth cap (progress events), then
   ``rslurm daemon --once`` to the POSIX tier with ``local_min_free=99%``: every local step is evicted
   (the node's NVMe is as good as lost).
3. The same launch again: the ranks restore from the durable tier and finish (``durable_wait=0``).
4. A rank that ignores the emergency request (deadline missed), a save that cannot fit (save failed), a
   daemon draining to a bucket that does not exist (drain failed).

On the Slurm test cluster: a two-node job gets ``scancel --batch --signal=USR1``, saves, is requeued,
resumes on both nodes from their local tiers and is then cancelled (decision, requeue call, not
requeued), and each node's log holds only what happened on that node.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import s3_support
from conftest import REPO, clean_env, free_port, read_jsonl, run_rslurm, wait_for_step
from prometheus_client.parser import text_string_to_metric_families
from s3_support import MotoServer
from slurm_cluster import SlurmCluster

from resilient_slurm.manifest import step_dirname
from resilient_slurm.telemetry import EventLog

moto_server = s3_support.moto_server

PY = sys.executable
DOC = REPO / "docs" / "telemetry.md"
RUN = "toy"
STEPS = 40
EVERY = 4
REQUEUE = 75
SLURM_ONLY = {"decision", "not_requeued", "requeue_call", "save_signal_sent"}  # launcher events that need a Slurm job
# A stop while a Slurm job's ranks are still starting: test_launcher_slurm's
# test_a_stop_while_ranks_start_waits_for_them_instead_of_killing_them checks its fields, and
# tests/test_deferred_save_signal.py every way a held-back signal is sent or withheld.
SLURM_STARTUP_ONLY = {"save_signal_deferred", "save_signal_withheld"}
# A hung or crashed run of the ranks: tests/test_hang.py writes these (and checks their fields against
# docs/telemetry.md with check_records).
HANG_ONLY = {"hang", "in_job_restart"}
# A node that fails its health check, and a stop during the check (the ranks are then not started):
# tests/test_health.py (local) and test_launcher_slurm.py write them, test_health checks their fields against
# docs/telemetry.md.
HEALTH_ONLY = {"node_unhealthy", "ranks_not_started"}
# A start that never gets there, on Slurm: test_launcher_slurm's
# test_a_rendezvous_that_cannot_work_ends_within_the_startup_bound writes startup_failed, and
# tests/test_startup.py a launcher's startup_not_judged; both check them against these docs.
STARTUP_ONLY = {"startup_failed", "startup_not_judged"}
# Rank events written only when a rank is slower than its peers: tests/test_stragglers.py checks them
# against these docs.
STRAGGLER_ONLY = {"straggler", "straggler_cleared"}
# Rank events written only after a resume that trains steps again, with metrics recorded: tests/test_rehearse.py
# writes them (a SIGKILLed rank, an in-job restart) and checks their fields against these docs.
RESUME_ONLY = {"resume_verified", "resume_diverged"}
# Rank events written only when a step saved by another git commit or command line is restored:
# tests/test_provenance.py writes them (a program in a temporary git repository, changed and committed, run
# with other arguments) and checks them against these docs.
PROVENANCE_ONLY = {"code_version_changed", "command_line_changed"}
# A rank event written only when the program tags a step (ckpt.tag): tests/test_tags.py writes it (three ranks
# on two emulated nodes) and checks its fields against these docs.
TAG_ONLY = {"tagged"}
# A rank event of storage domains on several nodes (peer replicas): this module's Slurm test (two nodes)
# checks its fields; the single-node scenario has no partner.
PEER_ONLY = {"peer_replica"}
# Rank events of a local launcher's ranks once it died: tests/test_launcher_orphans.py writes them (a SIGKILLed
# launcher) and checks their fields against these docs.
ORPHAN_ONLY = {"launcher_gone", "orphan_timeout"}

# A rank that never saves: ignores SIGTERM (which the launcher forwards when no rank registered) and the
# save signal, and says when it is ready.
STUCK = textwrap.dedent("""
    import os, signal, sys, time
    for s in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    open(sys.argv[1], "w").close()
    time.sleep(300)
""")


# --------------------------------------------------------------------------- what the docs say
@dataclass
class Docs:
    common: dict[str, set[str]]  # field -> sources whose records carry it
    events: dict[tuple[str, str], list[str]]  # (source, event) -> fields
    metrics: dict[str, tuple[str, set[str]]]  # name -> (type, labels)

    def record_keys(self, source: str, event: str) -> set[str]:
        return {f for f, sources in self.common.items() if source in sources} | set(self.events[(source, event)])


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Rows (cells) of the markdown tables under each heading, header and separator rows dropped."""
    out: dict[str, list[list[str]]] = {}
    heading, header_seen = "", False
    for line in text.splitlines():
        if line.startswith("#"):
            heading, header_seen = line.lstrip("#").strip(), False
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            if not header_seen:
                header_seen = True
                continue
            out.setdefault(heading, []).append(cells)
    return out


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def read_docs() -> Docs:
    tables = _tables(DOC.read_text())
    common: dict[str, set[str]] = {}
    for name, where, _ in tables["Common fields"]:
        sources = {"rank", "launcher", "daemon"} if where == "every record" else {s.strip() for s in where.split(",")}
        common[_names(name)[0]] = sources
    events: dict[tuple[str, str], list[str]] = {}
    for source in ("rank", "launcher", "daemon"):
        for name, fields, _ in tables[f"{source.capitalize()} events"]:
            events[(source, _names(name)[0])] = _names(fields)
    metrics = {_names(name)[0]: (kind, set(_names(labels))) for name, kind, labels, _ in tables["Metrics"]}
    assert len(events) > 20 and len(metrics) > 10 and "t" in common, "docs/telemetry.md tables not found"
    return Docs(common, events, metrics)


def check_records(docs: Docs, records: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """Every record is documented and has exactly the documented fields; returns the (source, event)s seen."""
    seen = set()
    for r in records:
        key = (r.get("source", "?"), r.get("event", "?"))
        assert key in docs.events, f"undocumented event {key} in docs/telemetry.md: {r}"
        want = docs.record_keys(*key)
        assert set(r) == want, f"{key}: fields {sorted(set(r))}, docs say {sorted(want)}: {r}"
        seen.add(key)
    return seen


def check_order(records: list[dict[str, Any]], where: str) -> None:
    """Each writer's records are in time order (ranks, the launcher and daemons ran one after another)."""
    last: dict[tuple[Any, ...], float] = {}
    for r in records:
        who = (r["source"], r["node"], r.get("rank"))
        assert r["t"] >= last.get(who, 0.0), f"{where}: {who} went back in time at {r}"
        last[who] = r["t"]


def parse_prom(path: Path) -> dict[str, Any]:
    """name (as documented, counters with _total) -> (type, [(labels, value)])."""
    out: dict[str, Any] = {}
    for fam in text_string_to_metric_families(path.read_text()):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, [(s.labels, s.value) for s in fam.samples])
    return out


def check_prom(docs: Docs, path: Path) -> dict[str, Any]:
    """The textfile has every documented metric with its type and labels, and nothing else; returns
    {name: value} for per-node metrics and {name: {run_id: value}} for per-run ones."""
    prom = parse_prom(path)
    assert set(prom) == set(docs.metrics), (f"{path}: metrics {sorted(prom)} vs documented {sorted(docs.metrics)}")
    values: dict[str, Any] = {}
    for name, (kind, samples) in prom.items():
        want_kind, want_labels = docs.metrics[name]
        assert kind == want_kind, f"{name}: {kind}, docs say {want_kind}"
        assert samples, f"{name}: no sample in {path}"
        for labels, _ in samples:
            assert set(labels) == want_labels, f"{name}: labels {sorted(labels)}, docs say {sorted(want_labels)}"
        if "run_id" in want_labels:
            values[name] = {labels["run_id"]: v for labels, v in samples}
        else:
            assert len(samples) == 1, (name, samples)
            values[name] = samples[0][1]
    return values


def manifest(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / "manifest.json").read_text())
    return data


def shard_sizes(m: dict[str, Any], node: str | None = None) -> dict[int, int]:
    """rank -> shard size of a manifest (of one node's shards when ``node`` is given)."""
    ranks = set(m["nodes"][node]) if node else None
    return {s["rank"]: s["size"] for s in m["shards"] if ranks is None or s["rank"] in ranks}


# --------------------------------------------------------------------------- the local scenario
@dataclass
class Scenario:
    root: Path
    nvme: Path  # node n1's local tier
    lustre: Path
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (start, end) unix time
    manifests: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> local manifest (n1)
    emergency_step: int = -1
    s3_manifests: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def events(self, run: str = RUN) -> list[dict[str, Any]]:
        return read_jsonl(self.nvme / run / "events.jsonl")

    def all_events(self) -> list[dict[str, Any]]:
        return [e for p in sorted(self.nvme.glob("*/events.jsonl")) for e in read_jsonl(p)]

    def during(self, phase: str, run: str = RUN, **match: Any) -> list[dict[str, Any]]:
        t0, t1 = self.windows[phase]
        return [e for e in self.events(run) if t0 <= e["t"] <= t1 and all(e.get(k) == v for k, v in match.items())]

    def prom(self, name: str) -> Path:
        return self.root / "prom" / f"{name}.prom"


class Phase:
    """Records the wall-clock window of one phase, so the events of each daemon can be told apart."""

    def __init__(self, sc: Scenario, name: str) -> None:
        self.sc, self.name = sc, name

    def __enter__(self) -> None:
        self.t0 = time.time()

    def __exit__(self, *exc: object) -> None:
        self.sc.windows[self.name] = (self.t0, time.time())


def _env(sc: Scenario, ctl: str, **extra: str) -> dict[str, str]:
    return clean_env({"RSLURM_LOCAL_DIR": str(sc.root / "nvme" / "%n"), "RSLURM_NODE_NAME": "n1", "RSLURM_RUN_ID": RUN,
                      "RSLURM_CONTROL_DIR": ctl, "RSLURM_LOG_LEVEL": "INFO", **extra})


def _launch(sc: Scenario, env: dict[str, str], argv: list[str], n: int, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    err = sc.root / f"{name}.err"
    with open(err, "wb") as e:
        proc = subprocess.Popen([PY, "-m", "resilient_slurm.cli", "launch", "-n", str(n), "--", *argv], env=env,
                                cwd=sc.root, stdin=subprocess.DEVNULL, stdout=e, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, err


def _wait(proc: subprocess.Popen[bytes], err: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        pytest.fail(f"{err.stem} did not finish within {timeout}s:\n{err.read_text(errors='replace')[-4000:]}")


def _daemon(sc: Scenario, env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "resilient_slurm.cli", "daemon", "--once"], env=env, cwd=sc.root,
                          capture_output=True, text=True, timeout=120)


def _toy(sc: Scenario) -> list[str]:
    return [PY, "-m", "resilient_slurm.examples.train_toy", "--steps", str(STEPS), "--every-steps", str(EVERY),
            "--workers", "1", "--hidden", "128", "--step-sleep", "0.1", "--log", str(sc.root / "log.%r.jsonl")]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, moto_server: MotoServer) -> Iterator[Scenario]:
    root = tmp_path_factory.mktemp("telemetry")
    sc = Scenario(root, root / "nvme" / "n1", root / "lustre")
    (root / "prom").mkdir()
    ctl = tempfile.mkdtemp(prefix="rsl-", dir="/tmp")  # socket paths must stay short
    posix = {"RSLURM_DURABLE": f"file://{sc.lustre}"}
    try:
        # 1. train, SIGTERM, emergency save drained by the launcher's own daemon
        with Phase(sc, "train"):
            env = _env(sc, ctl, **posix, RSLURM_METRICS_TEXTFILE=str(sc.prom("job")))
            proc, err = _launch(sc, env, _toy(sc), 2, "train")
            wait_for_step(root / "log.0.jsonl", 18, timeout=150)
            os.kill(proc.pid, signal.SIGTERM)
            rc = _wait(proc, err, 120)
            assert rc == REQUEUE, f"launcher exited {rc}:\n{err.read_text(errors='replace')[-4000:]}"
        steps = sorted(int(p.name[5:]) for p in sc.nvme.joinpath(RUN).glob("step_*") if p.name[5:].isdigit())
        sc.emergency_step = steps[-1]
        sc.manifests = {s: manifest(sc.nvme / RUN / step_dirname(s)) for s in steps}
        assert sc.manifests[sc.emergency_step]["reason"] == "emergency", sc.manifests[sc.emergency_step]

        # 2a. drain to S3 with a bandwidth cap: transfers take long enough for progress events
        bucket = moto_server.new_bucket()
        s3 = {"RSLURM_DURABLE": f"s3://{bucket}/ckpt", "RSLURM_S3_ENDPOINT_URL": moto_server.endpoint}
        with Phase(sc, "s3"):
            r = _daemon(sc, _env(sc, ctl, **s3, RSLURM_DRAIN_BANDWIDTH="300K", RSLURM_DRAIN_POLL_INTERVAL="0.2",
                                 RSLURM_METRICS_TEXTFILE=str(sc.prom("s3"))), "s3")
            assert r.returncode == 0, r.stderr
        client = moto_server.client()
        for s in steps:
            body = client.get_object(Bucket=bucket, Key=f"ckpt/{RUN}/{step_dirname(s)}/manifest.json")["Body"].read()
            sc.s3_manifests[s] = json.loads(body)

        # 2b. the local tier must be 99% free: every (durable) local step is evicted
        with Phase(sc, "evict"):
            r = _daemon(sc, _env(sc, ctl, **posix, RSLURM_LOCAL_MIN_FREE="99%",
                                 RSLURM_METRICS_TEXTFILE=str(sc.prom("posix"))), "posix")
            assert r.returncode == 0, r.stderr
        assert not list(sc.nvme.joinpath(RUN).glob("step_*")), "eviction left steps behind"
        sc.notes["durable_manifest"] = manifest(sc.lustre / RUN / step_dirname(sc.emergency_step))

        # 3. run again: restore from the durable tier, train to the end
        with Phase(sc, "resume"):
            env = _env(sc, ctl, **posix, RSLURM_DURABLE_WAIT="0", RSLURM_METRICS_TEXTFILE=str(sc.prom("job2")))
            proc, err = _launch(sc, env, _toy(sc), 2, "resume")
            rc = _wait(proc, err, 180)
            assert rc == 0, f"resumed run exited {rc}:\n{err.read_text(errors='replace')[-4000:]}"
        for p in sc.nvme.joinpath(RUN).glob("step_*"):
            sc.manifests[int(p.name[5:])] = manifest(p)

        # 4a. a rank that never saves: the launcher's deadline passes
        with Phase(sc, "stuck"):
            ready = root / "stuck.ready"
            env = _env(sc, ctl, RSLURM_RUN_ID="stuck", RSLURM_SAVE_TIMEOUT="1")
            proc, err = _launch(sc, env, [PY, "-c", STUCK, str(ready)], 1, "stuck")
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert time.monotonic() < deadline and proc.poll() is None, err.read_text(errors="replace")
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGTERM)
            assert _wait(proc, err, 60) == REQUEUE, err.read_text(errors="replace")[-3000:]

        # 4b. a save that cannot fit: free_space_margin larger than any disk
        with Phase(sc, "full"):
            env = _env(sc, ctl, RSLURM_RUN_ID="full", RSLURM_FREE_SPACE_MARGIN=str(1 << 60))
            r2 = subprocess.run([*_toy(sc)[:-2], "--log", str(root / "full.jsonl")], env=env, cwd=root,
                                capture_output=True, text=True, timeout=120)
            assert r2.returncode != 0 and "free" in r2.stderr, r2.stderr[-3000:]

        # 4c. a bucket that does not exist: every drain fails
        with Phase(sc, "nobucket"):
            bad = {"RSLURM_DURABLE": "s3://rslurm-no-such-bucket/x", "RSLURM_S3_ENDPOINT_URL": moto_server.endpoint}
            r = _daemon(sc, _env(sc, ctl, **bad, RSLURM_METRICS_TEXTFILE=str(sc.prom("nobucket"))), "nobucket")
            assert r.returncode == 1, r.stderr

        # 4c'. the same under a daemon that keeps running: a failed step is queued again (drain_retry; --once
        # tries each step once). Stopped (SIGINT) once it has queued one again.
        with Phase(sc, "retry"):
            t0 = time.time()
            d = subprocess.Popen([PY, "-m", "resilient_slurm.cli", "daemon"], env=_env(sc, ctl, **bad), cwd=sc.root,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                deadline = time.monotonic() + 60
                while not [e for e in sc.events(RUN) if e["t"] >= t0 and e["event"] == "drain_retry"]:
                    assert time.monotonic() < deadline and d.poll() is None, "no drain_retry from a daemon left running"
                    time.sleep(0.05)
            finally:
                d.send_signal(signal.SIGINT)
                _, derr = d.communicate(timeout=60)
            assert d.returncode == 1, derr.decode(errors="replace")[-3000:]  # stopped, with steps not drained

        # 4d. a desynchronised DDP replica (rank 1 nudges a parameter before a save), then drained
        with Phase(sc, "desync"):
            out = root / "desync"
            out.mkdir()
            worker = [PY, str(REPO / "tests" / "workers" / "replica_worker.py"), "save", "--out", str(out),
                      "--perturb-rank", "1"]
            proc, err = _launch(sc, _env(sc, ctl, RSLURM_RUN_ID="desync"), worker, 2, "desync")
            assert _wait(proc, err, 120) == 0, err.read_text(errors="replace")[-3000:]
            r = _daemon(sc, _env(sc, ctl, **posix, RSLURM_RUN_ID="desync",
                                 RSLURM_METRICS_TEXTFILE=str(sc.prom("desync"))), "desync")
            assert r.returncode == 0, r.stderr

        # 4e. nothing local and a durable tier nobody answers on: restore refuses to start over
        #     (restore_failed) and the launcher requeues (storage_unavailable)
        with Phase(sc, "unreachable"):
            dead = {"RSLURM_DURABLE": "s3://nobody/x", "RSLURM_S3_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
                    "RSLURM_S3_MAX_ATTEMPTS": "1"}
            proc, err = _launch(sc, _env(sc, ctl, **dead, RSLURM_RUN_ID="unreach"),
                                [*_toy(sc)[:-2], "--log", str(root / "unreach.%r.jsonl")], 1, "unreach")
            assert _wait(proc, err, 120) == REQUEUE, err.read_text(errors="replace")[-3000:]
            assert "storage_unavailable" in err.read_text(errors="replace")
        yield sc
    finally:
        shutil.rmtree(ctl, ignore_errors=True)


# --------------------------------------------------------------------------- tests
@pytest.mark.proc
def test_every_documented_event_appears_with_exactly_its_fields(scenario: Scenario) -> None:
    docs = read_docs()
    records = scenario.all_events()
    seen = check_records(docs, records)
    missing = set(docs.events) - seen - {("launcher", e) for e in SLURM_ONLY | SLURM_STARTUP_ONLY | HANG_ONLY
                                                            | HEALTH_ONLY | STARTUP_ONLY} - {("rank", e) for e in STRAGGLER_ONLY
                                                                               | RESUME_ONLY
                                                                               | PROVENANCE_ONLY
                                                                               | TAG_ONLY
                                                                               | PEER_ONLY
                                                                               | ORPHAN_ONLY}
    assert not missing, f"documented but never written: {sorted(missing)}"
    for p in scenario.nvme.glob("*/events.jsonl"):
        check_order(read_jsonl(p), str(p))
        assert all(len(line) < 4000 for line in p.read_bytes().splitlines())
    assert {r["node"] for r in records} == {"n1"} and {r["run_id"] for r in records} == {RUN, "stuck", "full", "desync",
                                                                             "unreach"}


@pytest.mark.proc
def test_save_events_match_the_manifests(scenario: Scenario) -> None:
    ev = scenario.events()
    committed = {(e["step"], e["rank"]): e for e in ev if e["event"] == "save_committed"}
    staged = {(e["step"], e["rank"]): e for e in ev if e["event"] == "save_staged"}
    started = [e for e in ev if e["event"] == "save_started"]
    assert {e["rank"] for e in started} == {0}, "only the node's leader writes save_started"
    assert sorted({s for s, _ in committed}) == sorted({e["step"] for e in started})
    for step, m in scenario.manifests.items():
        sizes = shard_sizes(m)
        for rank, size in sizes.items():
            c, s = committed[(step, rank)], staged[(step, rank)]
            assert c["bytes"] == s["bytes"] == size, (step, rank, c, s, size)
            assert c["step_bytes"] == sum(sizes.values())
            assert c["reason"] == s["reason"] == m["reason"]
            assert c["throughput_bytes_s"] == pytest.approx(c["bytes"] / c["write_s"], rel=1e-2)
            assert c["total_s"] >= c["write_s"] > 0 and s["stall_s"] >= s["wait_s"] >= 0
    emergency = [e for e in ev if e["event"] == "emergency_requested"]
    assert sorted(e["rank"] for e in emergency) == [0, 1], emergency
    assert {e["step"] for e in emergency} == {scenario.emergency_step}
    # SIGTERM reached the launcher, which asked the ranks over the control socket; a rank whose poll came
    # first learnt it from the other at the step agreement.
    assert {e["how"] for e in emergency} <= {"control_socket", "peer"} and "control_socket" in {e["how"] for e in emergency}
    local_retention = scenario.during("train", event="retention_deleted", source="rank")
    assert local_retention and all(e["tier"] == "local" and e["rank"] == 0 for e in local_retention)
    deleted = {s for e in local_retention for s in e["steps"]}
    kept = set(scenario.s3_manifests)  # what the first run left in the local tier
    assert 4 in deleted and max(deleted) < min(kept), (deleted, kept)
    failed = [e for e in scenario.events("full") if e["event"] == "save_failed"]
    assert [(e["step"], e["rank"]) for e in failed] == [(EVERY, 0)] and "free" in failed[0]["error"], failed


@pytest.mark.proc
def test_launcher_events_tell_the_stop_and_the_restore_reads_the_durable_tier(scenario: Scenario) -> None:
    e = scenario.emergency_step
    train = scenario.during("train", source="launcher")
    assert [r["event"] for r in train] == ["start", "signal", "save_requested", "committed", "ranks_exited",
                                           "durable"], train
    assert train[1]["signal"] == train[2]["signal"] == "SIGTERM" and train[3]["step"] == train[5]["step"] == e
    assert train[0]["baseline_step"] is None and train[3]["after_signal_s"] >= 0
    assert {r["restart_count"] for r in train} == {0} and {r["job_id"] for r in train} == {None}
    fresh = scenario.during("train", event="restore_none")
    assert sorted(r["rank"] for r in fresh) == [0, 1]

    resume = scenario.during("resume")
    restores = sorted((r for r in resume if r["event"] == "restore"), key=lambda r: r["rank"])
    assert [(r["rank"], r["step"], r["tier"]) for r in restores] == [(0, e, "durable"), (1, e, "durable")], restores
    dm = scenario.notes["durable_manifest"]
    assert restores[0]["fetched_bytes"] == sum(shard_sizes(dm, "n1").values()) and restores[1]["fetched_bytes"] == 0
    for r in restores:
        assert 0 < r["bytes"] <= sum(shard_sizes(dm).values()) and r["seconds"] > 0 and r["skipped"] == []
    launcher = [r for r in resume if r["source"] == "launcher"]
    assert [r["event"] for r in launcher] == ["start", "ranks_exited", "not_durable"], launcher
    assert launcher[0]["baseline_step"] is None  # the local tier had lost every step

    stuck = [r["event"] for r in scenario.events("stuck") if r["source"] == "launcher"]
    assert stuck == ["start", "signal", "save_requested", "deadline_missed", "ranks_exited"], stuck


@pytest.mark.proc
def test_daemon_events_and_metrics_match_the_drained_steps(scenario: Scenario) -> None:
    docs = read_docs()
    e = scenario.emergency_step
    steps = sorted(scenario.s3_manifests)

    # the launcher's own daemon (POSIX), during training
    job = scenario.during("train", source="daemon")
    drained_list = [r for r in job if r["event"] == "drained"]
    for r in drained_list:
        if r["step"] in steps:
            assert r["bytes"] == r["file_bytes"] == sum(shard_sizes(scenario.manifests[r["step"]], "n1").values()), r
    assert e in {r["step"] for r in drained_list} and any(r["event"] == "durable_commit" and r["step"] == e for r in job)
    retention = [r for r in job if r["event"] == "retention_deleted"]
    assert retention and all(r["tier"] == "durable" and max(r["steps"]) < min(steps) for r in retention), retention
    jm = check_prom(docs, scenario.prom("job"))
    assert jm["rslurm_daemon_up"] == 0, "a clean exit writes up 0"
    assert jm["rslurm_durable_newest_step"] == {RUN: e} and jm["rslurm_local_newest_step"] == {RUN: e}
    assert jm["rslurm_drained_bytes_total"] == sum(r["bytes"] for r in drained_list)
    assert jm["rslurm_drained_steps_total"] == len(drained_list) >= 4
    assert check_prom(docs, scenario.prom("job2"))["rslurm_daemon_up"] == 0  # the resumed run's daemon

    # S3, --once, bandwidth cap: every kept step drained; the files are the manifests', sent compressed
    # (durable_compression auto is zstd on S3: these shards of trained weights shrink to about 0.6)
    s3 = scenario.during("s3", source="daemon")
    drained = {r["step"]: r for r in s3 if r["event"] == "drained"}
    assert sorted(drained) == steps and sorted(r["step"] for r in s3 if r["event"] == "drain_started") == steps
    for s, r in drained.items():
        assert r["file_bytes"] == sum(shard_sizes(scenario.s3_manifests[s], "n1").values())
        assert 0 < r["bytes"] < r["file_bytes"], r
        assert r["reused_bytes"] == 0
        assert r["state"] == "durable" and r["throughput_bytes_s"] == pytest.approx(r["bytes"] / r["seconds"], rel=1e-2)
    assert sorted(r["step"] for r in s3 if r["event"] == "durable_commit") == steps
    progress = [r for r in s3 if r["event"] == "drain_progress"]
    assert progress and all(0 < r["bytes_done"] <= r["bytes_total"] for r in progress), progress
    lag = [r for r in s3 if r["event"] == "drain_lag"]
    assert lag[0]["seconds"] > 0 and lag[0]["oldest_step"] == steps[0] and lag[0]["steps_behind"] == len(steps)
    assert lag[-1] == {**lag[-1], "seconds": 0.0, "oldest_step": None, "steps_behind": 0}, lag
    sm = check_prom(docs, scenario.prom("s3"))
    assert sm["rslurm_drained_bytes_total"] == sum(r["bytes"] for r in drained.values())
    assert sm["rslurm_drained_steps_total"] == sm["rslurm_durable_commits_total"] == len(steps)
    assert sm["rslurm_drain_seconds_total"] == pytest.approx(sum(r["seconds"] for r in drained.values()), rel=1e-3)
    assert sm["rslurm_drain_failures_total"] == sm["rslurm_local_evicted_steps_total"] == 0
    assert sm["rslurm_durable_newest_step"] == sm["rslurm_local_newest_step"] == {RUN: e}
    assert sm["rslurm_drain_lag_seconds"] == {RUN: 0} and sm["rslurm_steps_pending_drain"] == {RUN: 0}
    assert sm["rslurm_drain_throughput_bytes_per_second"] == pytest.approx(drained[steps[0]]["throughput_bytes_s"])
    assert sm["rslurm_daemon_up"] == 0 and sm["rslurm_local_free_bytes"] > 0
    assert sm["rslurm_daemon_start_time_seconds"] <= sm["rslurm_daemon_last_update_timestamp_seconds"]

    # POSIX, --once, local_min_free=99%: nothing to send, every local step evicted
    ev = scenario.during("evict", source="daemon")
    evicted = [r for r in ev if r["event"] == "evicted"]
    assert sorted(r["step"] for r in evicted) == steps and all(r["durable"] for r in evicted), evicted
    for r in evicted:
        assert r["bytes"] == sum(shard_sizes(scenario.manifests[r["step"]], "n1").values())
    pm = check_prom(docs, scenario.prom("posix"))
    assert pm["rslurm_local_evicted_steps_total"] == len(steps) and pm["rslurm_drained_bytes_total"] == 0
    assert pm["rslurm_local_newest_step"] == {RUN: -1} and pm["rslurm_durable_newest_step"] == {RUN: e}
    assert pm["rslurm_local_min_free_bytes"] > pm["rslurm_local_free_bytes"]

    # a bucket that does not exist: each pending step fails once, counted (--once: not retried by that run);
    # a daemon left running queues a failed step again
    rt = scenario.during("retry", source="daemon")
    assert [r for r in rt if r["event"] == "drain_failed" and r["will_retry"]], rt
    assert [r for r in rt if r["event"] == "drain_retry" and r["retry_in_s"] > 0], rt
    nb = scenario.during("nobucket", source="daemon")
    failed = [r for r in nb if r["event"] == "drain_failed"]
    assert failed and all(r["attempt"] == 1 and not r["will_retry"] and "rslurm-no-such-bucket" in r["error"]
                          for r in failed), failed
    nm = check_prom(docs, scenario.prom("nobucket"))
    assert nm["rslurm_drain_failures_total"] == len(failed) and nm["rslurm_drained_steps_total"] == 0
    assert nm["rslurm_durable_newest_step"] == {RUN: -1} and nm["rslurm_steps_pending_drain"] == {RUN: len(failed)}
    # The goodput is rslurm report's, from the same event log and history (nothing ran in the run since); while
    # the run trained (the launcher's own daemon) it was already known.
    report = run_rslurm("report", "--json", RUN, env={"RSLURM_LOCAL_DIR": str(scenario.nvme)})
    assert report.returncode == 0, report.stderr
    assert nm["rslurm_run_goodput_ratio"][RUN] == pytest.approx(json.loads(report.stdout)["goodput"], rel=1e-6)
    assert 0 < check_prom(docs, scenario.prom("job"))["rslurm_run_goodput_ratio"][RUN] < 1


@pytest.mark.proc
def test_a_replica_mismatch_is_an_event_a_manifest_entry_and_a_daemon_metric(scenario: Scenario) -> None:
    ev = [e for e in scenario.events("desync") if e["event"] == "replica_mismatch"]
    assert [(e["step"], e["key"], e["ranks"], e["majority"], e["found_by"], e["action"], e["rank"]) for e in ev] == [
        (3, "model.0.weight", [1], [0], "digest", "warn", 0)], ev
    m = manifest(scenario.nvme / "desync" / step_dirname(3))
    assert m["extra"]["replica_mismatch"] == [{"key": "model.0.weight", "majority": [0], "ranks": [1]}]
    dm = check_prom(read_docs(), scenario.prom("desync"))
    assert dm["rslurm_replica_mismatches_total"] == 1 and dm["rslurm_drained_steps_total"] == 2


@pytest.mark.proc
def test_metrics_textfile_that_node_exporter_would_not_read_is_refused(tmp_path: Path) -> None:
    base = {"RSLURM_LOCAL_DIR": str(tmp_path / "nvme"), "RSLURM_DURABLE": str(tmp_path / "lustre")}
    for path, says in ((tmp_path / "rslurm.txt", ".prom"), (tmp_path / "no-such-dir" / "rslurm.prom", "does not exist")):
        r = subprocess.run([PY, "-m", "resilient_slurm.cli", "daemon", "--once"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env=clean_env({**base, "RSLURM_METRICS_TEXTFILE": str(path)}))
        assert r.returncode == 2 and "rslurm: error:" in r.stderr and says in r.stderr, r.stderr
        assert "RSLURM_METRICS_TEXTFILE" in r.stderr or "metrics_textfile" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_event_log_failure_is_one_warning_and_never_an_exception(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "run").write_text("a file where the run directory should be")
    log = EventLog(str(tmp_path), "run", source="rank", node="n1", rank=0)
    with caplog.at_level(logging.DEBUG, logger="resilient_slurm.telemetry"):
        for i in range(3):
            log.emit("save_staged", step=i)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path / "run" / "events.jsonl") in warnings[0].getMessage()
    assert log.failures == 3
    (tmp_path / "run").unlink()
    log.emit("save_staged", step=3, error="x" * 10_000)  # works again; an oversized field is cut, not the line
    (rec,) = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert rec["step"] == 3 and rec["rank"] == 0 and len(rec["error"]) < 400


@pytest.mark.proc
def test_appends_from_many_processes_never_interleave(tmp_path: Path) -> None:
    writer = textwrap.dedent("""
        import sys
        from resilient_slurm.telemetry import EventLog
        log = EventLog(sys.argv[1], "run", source="rank", node="n1", rank=int(sys.argv[2]))
        for i in range(3000):
            log.emit("save_staged", step=i, pad="x" * (i % 2000))
    """)
    procs = [subprocess.Popen([PY, "-c", writer, str(tmp_path), str(r)], env=clean_env()) for r in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    lines = (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()
    recs = [json.loads(line) for line in lines]  # a torn or interleaved line would not parse
    assert len(recs) == 4 * 3000
    for r in range(4):
        assert [x["step"] for x in recs if x["rank"] == r] == list(range(3000))


# --------------------------------------------------------------------------- Slurm: requeue decisions
def _slurm_script(work: Path) -> str:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",  # nothing rendezvous-related: rslurm derives it
           "RSLURM_LOCAL_DIR": str(work / "nvme" / "%n"), "RSLURM_RUN_ID": RUN, "RSLURM_LOG_LEVEL": "INFO",
           "RSLURM_CONTROL_DIR": str(work.parent.parent / "ctl")}
    exports = "".join(f"export {k}='{v}'\n" for k, v in env.items())
    toy = [PY, "-m", "resilient_slurm.examples.train_toy", "--steps", "400", "--every-steps", str(EVERY),
           "--workers", "1", "--step-sleep", "0.1", "--log", str(work / "log.%r.jsonl")]
    cmd = " ".join([PY, "-m", "resilient_slurm.cli", "launch", "--", "srun", "-N2", "-n2", *toy])
    return f"#!/bin/bash\n{exports}exec {cmd}\n"


def _poll(what: str, cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.proc
def test_requeue_decisions_on_slurm_and_each_node_logs_its_own(slurm: SlurmCluster) -> None:
    """USR1 to the batch shell: decision and requeue call; the requeued incarnation restores from each
    node's local tier; scancel then: cancelled, not requeued. n1's log (the batch host) has the launcher's events and
    rank 0's, n2's has rank 1's only."""
    work = slurm.work_dir / "telemetry"
    work.mkdir()
    job = slurm.sbatch(_slurm_script(work), "-p", "low", "--requeue", "-N2", "--exclusive", "--open-mode=append",
                       "-o", str(work / "job.out"))
    logs = {n: work / "nvme" / n / RUN / "events.jsonl" for n in ("n1", "n2")}

    def events(node: str) -> list[dict[str, Any]]:
        return read_jsonl(logs[node]) if logs[node].exists() else []

    def launcher(kind: str) -> list[dict[str, Any]]:
        return [e for e in events("n1") if e["source"] == "launcher" and e["event"] == kind]

    try:
        wait_for_step(work / "log.0.jsonl", 6, timeout=120)
        slurm.run(["scancel", "--batch", "--signal=USR1", str(job)])
        _poll("the requeue call", lambda: bool(launcher("requeue_call")), 90)
        _poll("the second incarnation's restore",
              lambda: all(any(e["event"] == "restore" and e["restart_count"] == 1 for e in events(n)) for n in logs), 120)
        slurm.scancel(job)
        _poll("not_requeued", lambda: bool(launcher("not_requeued")), 90)
        slurm.wait_state(job, "CANCELLED", timeout=60)
    except BaseException:
        out = work / "job.out"
        print(out.read_text(errors="replace")[-6000:] if out.exists() else "(no job output)")
        raise
    docs = read_docs()
    seen = check_records(docs, events("n1") + events("n2"))
    assert {("launcher", e) for e in SLURM_ONLY} <= seen
    assert {("rank", e) for e in PEER_ONLY} <= seen, "each node's leader keeps the other's steps"
    for n in logs:
        check_order(events(n), n)
    first, second = launcher("decision")  # one per incarnation
    assert first["action"] == "requeue" and first["job_id"] == str(job) and first["restart_count"] == 0, first
    assert second["restart_count"] == 1 and (second["action"], second["outcome"]) == ("exit", "cancelled"), second
    assert launcher("requeue_call")[0]["action"] == "requeue"
    assert [e["state"] for e in launcher("not_requeued")] == ["COMPLETING"] and launcher("not_requeued")[0]["restart_count"] == 1
    assert not [e for e in events("n2") if e["source"] != "rank"], "n2 ran no launcher and no daemon"
    for node, rank in (("n1", 0), ("n2", 1)):
        ev = events(node)
        assert {e["rank"] for e in ev if e["source"] == "rank"} == {rank} and {e["node"] for e in ev} == {node}
        restores = [e for e in ev if e["event"] == "restore"]
        emergency = [e for e in ev if e["event"] == "emergency_requested" and e["restart_count"] == 0]
        assert [(e["restart_count"], e["tier"]) for e in restores] == [(1, "local")], restores
        assert len(emergency) == 1 and restores[0]["step"] == emergency[0]["step"], (emergency, restores)
    # Rank 1 is on n2, away from the launcher's socket: it hears scancel's USR2, or its peer first.
    assert [e["how"] for e in events("n2") if e["event"] == "emergency_requested"][0] in ("SIGUSR2", "peer")


def test_event_names_have_one_owner_and_every_one_is_documented() -> None:
    """telemetry.Event lists every event name the product writes, docs/telemetry.md documents each of them
    and no other, and no module writes an event by a string of its own (mypy types emit() and the
    launcher's event() with Event; this catches a literal that slipped past a cast)."""
    from resilient_slurm.telemetry import Event

    documented = {name for _, name in read_docs().events}
    assert {e.value for e in Event} == documented
    pkg = Path(__file__).resolve().parents[1] / "resilient_slurm"
    literal = re.compile(r"""\.(emit|event)\(\s*["']""")
    assert not [f"{p.relative_to(pkg)}:{n}" for p in pkg.rglob("*.py")
                for n, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
