"""Two ranks exercising one peer replica round after another (resilient_slurm/checkpoint/peers.py).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python peer_transfer_worker.py STEP_DIR DEST OUT

Rank 0 offers the committed step directory STEP_DIR (run "r") three times: with a header of another run,
with one shard's bytes changed after its manifest was written (a copy in DEST/tampered), then intact. Rank 1
receives each round into DEST/replicas/<domain>/ and writes what every round did to OUT (JSON): a bad offer
and a bad copy are refused, and the stream stays paired, so the third round commits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import torch.distributed as dist

from resilient_slurm.checkpoint.peers import StepSink, offer_of, transfer
from resilient_slurm.layout import TempKind, list_replicas, replica_run_dir
from resilient_slurm.manifest import MANIFEST_NAME, read_manifest_file


def main() -> None:
    step_dir, dest, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    m = read_manifest_file(os.path.join(step_dir, MANIFEST_NAME))
    results = []
    for case in ("other_run", "tampered", "intact"):
        if rank == 0:
            offer = offer_of(step_dir, "r", m.step, m.node, m)
            if case == "other_run":
                offer = dataclasses.replace(offer, header={**offer.header, "run": "someone-else"})
            elif case == "tampered":
                bad = os.path.join(dest, "tampered")
                shutil.copytree(step_dir, bad)
                shard = max(m.shards_of_node(m.node), key=lambda s: s.size).path
                with open(os.path.join(bad, shard), "r+b") as f:
                    f.seek(100)
                    b = f.read(1)
                    f.seek(100)
                    f.write(bytes([b[0] ^ 1]))
                offer = dataclasses.replace(offer, step_dir=bad)
            res = transfer(group, to=1, offer=offer, frm=None, sink=None, run_id="r")
        else:
            def commit(tmp: str, step: int, _m: object) -> None:
                os.rename(tmp, os.path.join(os.path.dirname(tmp), f"step_{step:012d}"))

            sink = StepSink("r", lambda d: replica_run_dir(dest, d), TempKind.REPLICA, "nonce",
                            free_space_margin=0, commit=commit)
            res = transfer(group, to=None, offer=None, frm=0, sink=sink, run_id="r")
            held = {d: (listing.committed, [t.name for t in listing.temps]) for d, listing in list_replicas(dest).items()}
            results.append({"case": case, "received": res.received, "declined": res.declined, "error": res.error,
                            "held": held})
    if rank == 1:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
