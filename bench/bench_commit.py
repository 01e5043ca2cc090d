"""Requests the durable commit makes at 16 to 256 emulated storage domains, against POSIX and S3 (issue 29,
item 1), beside the commit it replaced (every node GETs every domain's marker) measured in the same run.

    .venv/bin/python bench/bench_commit.py [--domains 16,64,256] [--tier posix,s3] [--json OUT]

One real save (``Checkpointer.save``, world size 1, a small state) is cloned into N node-local roots, each
holding one domain of an N-rank step (its own shard file, the ``.metadata``, a manifest that names all N
domains). Then every domain is drained with the real ``StepDrainer``, one after another, as N daemons that
finish in that order would: all but the last end ``waiting``, the last commits. Counted:

- S3 (a moto server in its own process, over HTTP on loopback): every HTTP request botocore sends
  (``before-send``: pages of a listing and retries each count), and the API calls by operation;
- POSIX (a directory under --dir): every call of the tier (a ``stat``, a directory read, a file written).

``previous`` is the same drain with the commit check the daemon had before (each node reads every domain's
marker manifest: N GETs per node per check), so the two columns differ only in the commit. Waiting nodes'
re-checks are not in either column (the scale model in bench/scale_model.py counts them).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import torch  # noqa: E402
from common import scratch_dir  # noqa: E402

from resilient_slurm import Checkpointer  # noqa: E402
from resilient_slurm.daemon.drain import LocalStep, StepDrainer, scan_local  # noqa: E402
from resilient_slurm.errors import CorruptCheckpointError, ObjectNotFoundError  # noqa: E402
from resilient_slurm.manifest import (  # noqa: E402
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    Manifest,
    domain_key,
    durable_step_key,
    read_durable_manifest,
)
from resilient_slurm.storage.fileio import checksum  # noqa: E402
from resilient_slurm.storage.posix import PosixTier  # noqa: E402
from resilient_slurm.storage.tier import StorageTier  # noqa: E402

RUN = "commit-bench"
STEP = 1
TIER_CALLS = ("put_file", "put_bytes", "get_bytes", "get_file", "stat", "list", "list_dirs", "list_names",
              "delete", "delete_prefix")


def domain_name(i: int) -> str:
    return f"node{i:04d}"


def emulate_domains(workdir: str, n: int) -> list[LocalStep]:
    """``n`` node-local roots under ``workdir``, each with one domain of the same ``n``-rank step."""
    seed_root = os.path.join(workdir, "seed")
    with Checkpointer(local_dir=seed_root, run_id=RUN) as ck:
        ck.save(STEP, {"w": torch.arange(1024, dtype=torch.float32)})
    (seed,) = scan_local(seed_root, [RUN])
    shard = seed.manifest.shards[0]
    nodes = {domain_name(i): (i,) for i in range(n)}
    shards = tuple(dataclasses.replace(shard, path=f"__{i}_0.distcp", rank=i, node=domain_name(i))
                   for i in range(n))
    out = []
    for i in range(n):
        d = domain_name(i)
        path = os.path.join(workdir, d, RUN, os.path.basename(seed.path))
        os.makedirs(path)
        shutil.copyfile(os.path.join(seed.path, shard.path), os.path.join(path, f"__{i}_0.distcp"))
        shutil.copyfile(os.path.join(seed.path, DCP_METADATA_NAME), os.path.join(path, DCP_METADATA_NAME))
        m = dataclasses.replace(seed.manifest, world_size=n, shards=shards, nodes=nodes, node=d)
        with open(os.path.join(path, MANIFEST_NAME), "w") as f:
            f.write(m.to_json())
        (ls,) = scan_local(os.path.join(workdir, d), [RUN])
        out.append(ls)
    shutil.rmtree(seed_root)
    return out


class PreviousCommit(StepDrainer):
    """The commit check the daemon had before: every domain's marker manifest read, one GET each."""

    def try_commit(self, run_id: str, step: int, m: Manifest) -> list[str]:
        missing, markers = [], {}
        for d in sorted(m.nodes):
            try:
                mk = read_durable_manifest(self.tier, run_id, step, d)
            except (ObjectNotFoundError, CorruptCheckpointError):
                missing.append(d)
                continue
            if mk.save_id != m.save_id:
                missing.append(d)
                continue
            markers[d] = mk
        if missing:
            return missing
        first = m.first_domain
        md = self.tier.get_bytes(domain_key(run_id, step, first, DCP_METADATA_NAME))
        assert checksum(md) == markers[first].dcp_metadata.checksum
        self.tier.put_bytes(durable_step_key(run_id, step, DCP_METADATA_NAME), md)
        self.tier.put_bytes(durable_step_key(run_id, step, MANIFEST_NAME), markers[first].as_durable().to_json().encode())
        return []


def counting(tier: StorageTier) -> collections.Counter[str]:
    """Count what ``tier`` asks of its store from now on: HTTP requests by operation on S3 (botocore's
    ``before-send``), calls of the tier's methods on POSIX."""
    counts: collections.Counter[str] = collections.Counter()
    client = getattr(tier, "_client", None)
    if client is not None:
        def on_call(model: Any, **_: Any) -> None:
            counts[model.name] += 1  # ListObjectsV2, PutObject...: one per page of a listing

        def on_send(**_: Any) -> None:
            counts["http"] += 1  # what reached the wire, retries included

        client.meta.events.register("before-call.s3", on_call)
        client.meta.events.register("before-send.s3", on_send)
        return counts
    for name in TIER_CALLS:
        fn = getattr(tier, name)

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _name: str = name, **kw: Any) -> Any:
            counts[_name] += 1
            out = _fn(*a, **kw)
            return list(out) if isinstance(out, Iterator) else out

        setattr(tier, name, wrapped)
    return counts


def commit_all(tier: StorageTier, steps: list[LocalStep], *, previous: bool = False) -> dict[str, Any]:
    """Drain every domain of the step, one after the other; what the commit cost."""
    counts = counting(tier)
    drainer = (PreviousCommit if previous else StepDrainer)(tier)
    states = [drainer.drain(ls) for ls in steps]
    committed = [s for s in states if s.committed]
    assert len(committed) == 1 and states[-1].committed, [s.state for s in states]
    assert all(s.state == "waiting" for s in states[:-1])
    read_durable_manifest(tier, RUN, STEP)  # the commit is there (not counted: counts copied first)
    total = counts.pop("http", None) or sum(counts.values())
    lists = sum(v for k, v in counts.items() if k.lower().startswith("list"))
    return {"domains": len(steps), "requests": total, "per_domain": total / len(steps), "lists": lists,
            "by_operation": dict(sorted(counts.items()))}


def make_tier(kind: str, workdir: str, endpoint: str | None, tag: str) -> StorageTier:
    if kind == "posix":
        return PosixTier(os.path.join(workdir, f"durable-{tag}"))
    import boto3

    from resilient_slurm.storage.s3 import S3Tier

    bucket = f"commit-{tag}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return S3Tier(f"{bucket}/bench", endpoint_url=endpoint, region="us-east-1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--domains", default="16,64,256")
    ap.add_argument("--tier", default="posix,s3")
    ap.add_argument("--dir", help="where to work (default: the temporary directory; made if missing)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    kinds = [k for k in args.tier.split(",") if k]
    moto = None
    work = scratch_dir(args.dir, "rslurm-commit-")
    rows = []
    try:
        if "s3" in kinds:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            from bench_drain import Moto

            moto = Moto(work)
        for n in [int(x) for x in args.domains.split(",")]:
            steps = emulate_domains(os.path.join(work, f"local-{n}"), n)
            for kind in kinds:
                endpoint = moto.url if moto else None
                new = commit_all(make_tier(kind, work, endpoint, f"{kind}-{n}-new"), steps)
                old = commit_all(make_tier(kind, work, endpoint, f"{kind}-{n}-old"), steps, previous=True)
                rows.append({"tier": kind, "domains": n, "linear": new, "previous": old,
                             "ratio": old["requests"] / new["requests"]})
                print(f"{kind:5} {n:4d} domains: {new['requests']:7,d} requests ({new['per_domain']:.1f} per domain, "
                      f"{new['lists']} LIST pages/directory reads); previous commit {old['requests']:7,d} "
                      f"({old['per_domain']:.1f} per domain): x{old['requests'] / new['requests']:.1f}", flush=True)
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("| tier | domains | requests per commit | per domain | LIST pages | previous commit | per domain | previous / now |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tier']} | {r['domains']} | {r['linear']['requests']:,} | {r['linear']['per_domain']:.1f} | "
              f"{r['linear']['lists']} | {r['previous']['requests']:,} | {r['previous']['per_domain']:.1f} | "
              f"{r['ratio']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
