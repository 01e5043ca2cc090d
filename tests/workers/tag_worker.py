"""One rank of a run that tags steps with ``ckpt.tag`` while retention (keep_last=1) removes the others.

    python tag_worker.py --local-dir D --run-id R --out O

Saves steps 1..6 (step 4 asynchronously, the others blocking) and:

* after step 2: ``ckpt.tag(2, "best")`` (a committed step);
* right after the non-blocking save of step 4: ``ckpt.tag(4, "v1")`` (its save is in flight: the tag waits
  for its commit);
* after step 5: ``ckpt.tag(3, "gone")`` (retention removed step 3: ConfigError), ``ckpt.tag(5, "a/b")``
  (a bad name: ConfigError), then ``ckpt.tag(5, "best")`` (moves "best" from step 2 to step 5) and back
  ``ckpt.tag(2, "best")``.

Each rank writes ``O/rank<r>.json``: the error text of each refused tag and the steps it saw committed.
The node name comes from ``RSLURM_NODE_NAME`` (set per rank by the test to emulate several nodes).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from resilient_slurm import Checkpointer, ConfigError, init_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local-dir", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    state = {"w": torch.zeros(1024), "step": 0}
    out: dict[str, object] = {}
    with Checkpointer(local_dir=a.local_dir, run_id=a.run_id, keep_last=1) as ckpt:
        for step in range(1, 7):
            state["w"] += rank + 1
            state["step"] = step
            ckpt.save(step, state, blocking=step != 4)
            if step == 2:
                ckpt.tag(2, "best")
            if step == 4:
                ckpt.tag(4, "v1")  # in flight
            if step == 5:
                for key, (s, name) in (("gone", (3, "gone")), ("bad", (5, "a/b"))):
                    try:
                        ckpt.tag(s, name)
                        out[key] = None
                    except ConfigError as exc:
                        out[key] = str(exc)
                ckpt.tag(5, "best")
                ckpt.tag(2, "best")
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
