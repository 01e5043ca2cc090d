"""Exact resume across topologies: SIGKILL at a random step, resume, and every rank ends bitwise equal to
a run that was never stopped.

The matrix: emulated nodes 1-3 (SLURMD_NODENAME per rank) x ranks per node 1-4 x directory layout (one
directory per node, one shared by every node, one per rank: one NVMe per GPU) x state kinds (a DDP model
with Adam; a per-rank object under a shared key; per-rank plain values and a per-rank tensor under shared
keys; a replicated plain value; an FSDP2 model with DTensor parameters) x the step of the SIGKILL. The
worker is tests/workers/topology_worker.py; every state kind feeds the training, so restoring one rank's
value into another changes the losses and the weights.

Property-based (hypothesis, derandomized): the explicit examples below always run and cover the layouts
users run (several ranks per node with per-rank state, per-GPU directories, a directory shared by every
node, DDP at 4 and 12 ranks, FSDP2); ``RSLURMTEST_MATRIX_EXAMPLES`` adds generated ones (default 0: the
derandomized draw is a fixed set that moves with every edit of this file; the two it gave were made
explicit, the 3-node shared directory with every kind, and one rank alone, which test_resume_bitwise.py
covers). A longer exploration:
``RSLURMTEST_MATRIX_EXAMPLES=200 .venv/bin/python -m pytest tests/test_topology_matrix.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from resume_matrix import KINDS, STEPS, check_resume

EXAMPLES = int(os.environ.get("RSLURMTEST_MATRIX_EXAMPLES", "0"))

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="multi-process gloo test")]


def _kinds() -> Any:
    return st.sets(st.sampled_from(KINDS), min_size=1).map(lambda s: tuple(k for k in KINDS if k in s))


@settings(max_examples=max(EXAMPLES, 1), derandomize=True, deadline=None, database=None,
          # a failing cell is reported as is: shrinking costs minutes
          phases=[Phase.explicit, Phase.generate] if EXAMPLES > 0 else [Phase.explicit],
          suppress_health_check=list(HealthCheck))
@given(nodes=st.integers(1, 3), per_node=st.integers(1, 4), layout=st.sampled_from(["node", "shared", "rank"]),
       kinds=_kinds(), kill_at=st.integers(4, STEPS - 3))
# The report: two ranks on one node, DDP, a per-rank object under a shared key.
@example(nodes=1, per_node=2, layout="node", kinds=("ddp", "obj"), kill_at=8)
# Eight GPUs per node in miniature: per-GPU directories, DDP at 4 ranks, every per-rank kind, FSDP2.
@example(nodes=1, per_node=4, layout="rank", kinds=KINDS, kill_at=9)
# One directory shared by every node (a parallel filesystem as local_dir), every kind.
@example(nodes=3, per_node=1, layout="shared", kinds=KINDS, kill_at=7)
# Two nodes of two ranks (its uninterrupted run is the 4-rank one above: same world size and kinds).
@example(nodes=2, per_node=2, layout="node", kinds=KINDS, kill_at=10)
# The largest cell: 12 ranks on 3 nodes, DDP at 12 ranks with per-rank state.
@example(nodes=3, per_node=4, layout="node", kinds=("ddp", "obj", "plain"), kill_at=8)
def test_sigkill_then_resume_is_bitwise_identical_in_every_topology(
    nodes: int, per_node: int, layout: str, kinds: tuple[str, ...], kill_at: int
) -> None:
    if "fsdp" in kinds and nodes * per_node == 1:
        kinds = tuple(k for k in kinds if k != "fsdp") or ("ddp",)  # FSDP2 needs a process group
    check_resume(nodes, per_node, layout, kinds, kill_at)
