"""Two ranks save in waves under a staging memory budget (tests/test_staging_waves.py); the first save
fails on the rank whose environment arms the ``during_waves`` failpoint. Prints one JSON line per rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer, failpoints

N = 100_000


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = sys.argv[1]
    state = {"w": torch.arange(N, dtype=torch.float32) + rank, "t": torch.randn(96, 64).t(), "meta": {"rank": rank}}
    errors = []
    with Checkpointer(local_dir=root, run_id="waves", capture_rng=False) as ck:
        waves = type(ck._engine._staging).__name__ if ck._engine._staging is not None else None
        try:
            ck.save(1, state)
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank was told
            errors.append(f"{type(exc).__name__}: {exc}")
        failpoints._ACTIVE.pop("during_waves", None)  # a `raise` point fires every time: once is the test
        state["w"] += 1
        ck.save(2, state)
        staging = type(ck._engine._staging).__name__
    fresh = {"w": torch.zeros(N), "t": torch.zeros(96, 64).t(), "meta": {}}
    with Checkpointer(local_dir=root, run_id="waves", capture_rng=False) as ck:
        step = ck.restore(fresh)
    same = all(torch.equal(fresh[k], state[k]) for k in ("w", "t")) and fresh["meta"] == state["meta"]
    print(json.dumps({"rank": rank, "errors": errors, "restored": step, "equal": same, "staging": staging,
                      "before": waves}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
