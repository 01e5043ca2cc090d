"""Two ranks save a state whose plain value ``extra`` restore could not load on rank 1 only (a torch.Generator);
rank 0's is a number (tests/test_staging_waves.py). Both ranks must be told at that save, none may hang; the
save after the value is fixed commits and restores. Prints one JSON line per rank."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from resilient_slurm import Checkpointer


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = sys.argv[1]
    state: dict[str, object] = {"w": torch.arange(1000, dtype=torch.float32) + rank,
                                "extra": torch.Generator() if rank == 1 else 0.5}
    errors = []
    with Checkpointer(local_dir=root, run_id="refused", capture_rng=False) as ck:
        try:
            ck.save(1, state)
        except Exception as exc:  # noqa: BLE001 - the test reads what each rank was told
            errors.append(f"{type(exc).__name__}: {exc}")
        state["extra"] = 0.5 + rank
        ck.save(2, state)
        ck.wait()
    fresh: dict[str, object] = {"w": torch.zeros(1000), "extra": None}
    with Checkpointer(local_dir=root, run_id="refused", capture_rng=False) as ck:
        step = ck.restore(fresh)
    print(json.dumps({"rank": rank, "errors": errors, "restored": step,
                      "equal": torch.equal(fresh["w"], state["w"]) and fresh["extra"] == state["extra"]}), flush=True)  # type: ignore[arg-type]
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
