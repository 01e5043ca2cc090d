"""Every cross-rank phase of the engine fails safely: made to fail on one rank, every rank raises one error
naming the failed rank, and no rank waits in a collective (checkpoint/coordination.py, ``Coordinator.phase``).

tests/workers/phase_worker.py walks two gloo ranks (two storage domains, a POSIX durable tier) through each
phase in turn: building a Checkpointer, a save (planning, replica proofs, writing, preparing, committing),
a step at a sync point, a save into a run with committed steps, a restore (listing, opening, comparing keys
held per rank, verifying, fetching a step one domain lost from the durable tier or copying it from the
partner's replica) and a tag. In each, the failpoint ``phase:<name>`` fails that phase on rank 1 only. The
ranks meet after every scenario, so a rank left waiting would hang the run: the test's timeout (with every
rank's stacks) says so. The shared-directory probe across hosts is not reached here (it needs hosts of
their own: tests/test_replication.py runs it in UTS namespaces).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]

WORKER = str(REPO / "tests" / "workers" / "phase_worker.py")
PHASES = 19  # scenarios in the worker: a phase renamed or dropped there fails this test


def test_a_phase_that_fails_on_one_rank_fails_on_every_rank_without_a_hang(tmp_path: Path) -> None:
    run_ranks([WORKER, "--root", str(tmp_path / "root"), "--out", str(tmp_path / "out.%r.json")], 2, tmp_path,
              timeout=480, per_rank_env=[{"SLURMD_NODENAME": "n1"}, {"SLURMD_NODENAME": "n2"}])
    results = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert [x["phase"] for x in results[0]] == [x["phase"] for x in results[1]] and len(results[0]) == PHASES
    for mine, other in zip(*results):
        for r, got in enumerate((mine, other)):
            assert got["error"] is not None, f"rank {r} did not fail in phase {got['phase']!r}: {got}"
            # Every rank learns that rank 1 failed and how (the failpoint's message), whatever class it raises.
            assert "rank 1" in got["error"] and f"failpoint phase:{got['phase']} triggered" in got["error"], got
