"""A small training program for the provenance and compatibility tests (tests/test_provenance.py,
tests/test_compat.py). The provenance test copies it into a temporary git repository and runs it there.

    python provenance_worker.py MODE LOCAL_DIR OUT [--step N]

Modes (every rank; gloo when WORLD_SIZE is set):
* ``save``: the original model (``Net(classes=C)``, ``--classes C``, default 2), 3 training steps,
  ``ckpt.save(N)`` (``--step N``, default 3) with
  ``Checkpointer(config=CONFIG)``; writes ``OUT/save.<rank>.json`` (the Checkpointer's provenance).
* ``resume``: the same objects, restore; writes ``OUT/resume.<rank>.json`` (the step restored).
* ``changed``: a changed model (``Net(classes=3, head=True, buffer=False)``); the restore must raise
  IncompatibleCheckpointError; writes ``OUT/changed.<rank>.json``: the error, whether the model is
  bitwise untouched and the optimizer's state count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

CONFIG = {"lr": 0.01, "layers": [4, 8], "name": "tiny", "nested": {"warmup": 10}}


class Net(torch.nn.Module):
    """body -> out, optionally a second head; a 'scale' buffer unless ``buffer`` is False."""

    def __init__(self, classes: int = 2, head: bool = False, buffer: bool = True) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, classes)
        self.head = torch.nn.Linear(8, 3) if head else None
        if buffer:
            self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if hasattr(self, "scale"):
            h = h * self.scale
        y = self.out(h).sum()
        return y + self.head(h).sum() if self.head is not None else y


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).backward()
        opt.step()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "resume", "changed"])
    ap.add_argument("local_dir")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--classes", type=int, default=2, help="save: the output layer's size")
    args = ap.parse_args()
    from resilient_slurm import Checkpointer, init_distributed
    from resilient_slurm.errors import IncompatibleCheckpointError

    rank = 0
    if os.environ.get("WORLD_SIZE"):
        rank, _, _ = init_distributed(backend="gloo")
    torch.manual_seed(0)
    model = Net(classes=3, head=True, buffer=False) if args.mode == "changed" else Net(args.classes)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state: dict[str, Any] = {"model": model, "opt": opt, "epoch": 0}
    doc: dict[str, Any] = {"rank": rank}
    with Checkpointer(local_dir=args.local_dir, run_id="prov", config=CONFIG) as ck:
        doc["provenance"] = ck.provenance
        if args.mode == "save":
            train(model, opt, 3)
            state["epoch"] = 1
            ck.save(args.step, state)
        elif args.mode == "resume":
            doc["step"] = ck.restore(state)
        else:
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                ck.restore(state)
                doc["error"] = None
            except IncompatibleCheckpointError as exc:
                doc["error"] = str(exc)
            after = model.state_dict()
            doc["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
            doc["opt_state"] = len(opt.state)
    with open(os.path.join(args.out, f"{args.mode}.{rank}.json"), "w") as f:
        json.dump(doc, f)
    # gloo may abort in interpreter teardown ("terminate called without an active exception"), after a
    # collective that raised on every rank and, rarely, after a clean save (CI): leave without it, the
    # result is written and the Checkpointer closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
