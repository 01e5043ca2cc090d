#!/usr/bin/env python3
"""Restore from the durable tier: bytes fetched and time, for the layouts a requeue meets (issue 14, item 2).

An FSDP2 MLP with Adam (bench/fetch_worker.py, gloo on CPU) is saved at 4 ranks on two emulated nodes (n1:
ranks 0-1, n2: ranks 2-3, ``RSLURM_NODE_NAME``), drained to a POSIX durable tier by ``rslurm daemon --once`` on
each node, then restored, the page cache dropped before each restore, in these cases (rounds interleave them):

- ``local``: the same 4 ranks on n1 and n2, nothing missing: a restore from the local tier (the floor);
- ``node wiped``: the same, n2's local directory wiped (an epilog, a reimaged node): n2 fetches;
- ``node replaced``: ranks 2-3 on a new node n3: n3 fetches;
- ``reshard 4 -> 2``: 2 ranks on two new nodes n3 and n4: both fetch;
- ``node wiped, from partner`` and ``node replaced, from partner``: the same two cases with peer replicas
  (``peer_replicas=auto``; the save kept each node's files on the other node too): the node copies its
  part from n1's replica over the job's gloo connections, 0 bytes from the durable tier. The other cases
  restore with ``peer_replicas=off``, which neither makes nor uses replicas.

For each: the restore's time (the ranks' own ``restore`` event, slowest rank; starting Python and the
process group is not counted), the bytes each fetching node fetched, the whole step's bytes (what a node
that had not written the step fetched before files were chosen by saved domain and load plan; a wiped node
always fetched its own files) and, as the
baseline, a plain copy (read, write, fsync) of the same files from the durable tier into an empty
directory, after the same cache drop. Every restore's full state (gathered on rank 0) must equal the saved
one (sha256). Usage::

    .venv/bin/python bench/bench_fetch.py [--mib 256] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

from common import (  # noqa: E402
    Cache,
    add_wait_quiet_arg,
    fmt,
    free_port,
    git_facts,
    log,
    machine_facts,
    med,
    read_jsonl,
    run_main,
    scratch_dir,
)

from resilient_slurm.manifest import partial_items, read_manifest_file  # noqa: E402
from resilient_slurm.storage.tier import Span, coalesce  # noqa: E402

RUN = "fetchbench"
WORKER = os.path.join(HERE, "fetch_worker.py")
# name -> (node of each rank, nodes whose local dir is wiped, whether partners' replicas may be used)
CASES: dict[str, tuple[list[str], list[str], bool]] = {
    "local": (["n1", "n1", "n2", "n2"], [], False),
    "node wiped": (["n1", "n1", "n2", "n2"], ["n2"], False),
    "node wiped, from partner": (["n1", "n1", "n2", "n2"], ["n2"], True),
    "node replaced": (["n1", "n1", "n3", "n3"], ["n3"], False),
    "node replaced, from partner": (["n1", "n1", "n3", "n3"], ["n3"], True),
    "reshard 4 -> 2": (["n3", "n4"], ["n3", "n4"], False),
}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = scratch_dir(args.dir, "rslurm-bench-fetch-")
        self.durable = os.path.join(self.root, "durable")
        self.cache = Cache()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RSLURM_", "SLURM_"))}
        self.env.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RSLURM_DURABLE": self.durable,
                         "RSLURM_AUTO_CADENCE": "off", "RSLURM_CONTROL_SOCKET": "off", "RSLURM_LOG_LEVEL": "WARNING",
                         "RSLURM_COLLECTIVE_TIMEOUT": "300"})

    def local(self, node: str) -> str:
        return os.path.join(self.root, "nvme", node)

    def ranks(self, mode: str, nodes: list[str], peers: bool = True) -> None:
        port = free_port()
        procs = []
        for r, node in enumerate(nodes):
            env = {**self.env, "RSLURM_PEER_REPLICAS": "auto" if peers else "off", "RANK": str(r), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": str(nodes[:r].count(node)),
                   "LOCAL_WORLD_SIZE": str(nodes.count(node)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RSLURM_NODE_NAME": node}
            out = open(os.path.join(self.root, f"{mode}.rank{r}.log"), "w")
            procs.append((subprocess.Popen(
                [sys.executable, WORKER, mode, "--mib", str(self.args.mib), "--local-dir",
                 os.path.join(self.root, "nvme", "%n"), "--run-id", RUN, "--out", self.root],
                env=env, stdout=out, stderr=subprocess.STDOUT), out))
        codes = []
        for p, out in procs:
            codes.append(p.wait(timeout=900))
            out.close()
        if any(codes):
            logs = "".join(open(os.path.join(self.root, f"{mode}.rank{r}.log")).read()[-3000:] for r in range(len(nodes)))
            raise SystemExit(f"{mode} ranks failed: {codes}\n{logs}")

    def save(self) -> dict[str, Any]:
        self.ranks("save", CASES["local"][0])  # each node's leader also keeps the other node's files
        for node in ("n1", "n2"):
            r = subprocess.run([sys.executable, "-m", "resilient_slurm.cli", "daemon", "--once"],
                               env={**self.env, "RSLURM_LOCAL_DIR": os.path.join(self.root, "nvme", "%n"),
                                    "RSLURM_NODE_NAME": node}, capture_output=True, text=True, timeout=600)
            if r.returncode:
                raise SystemExit(f"daemon on {node} failed: {r.stderr[-3000:]}")
        step = os.path.join(self.durable, RUN, f"step_{1:012d}")
        if not os.path.exists(os.path.join(step, "manifest.json")):
            raise SystemExit(f"{step}: not durable after both daemons ran")
        files = {f: os.path.getsize(os.path.join(step, f)) for f in os.listdir(step) if f.endswith(".distcp")}
        with open(os.path.join(self.root, "save.digest")) as f:
            self.saved_digest = f.read()
        return {"files": files, "step_bytes": sum(files.values())}

    def restore(self, case: str) -> dict[str, Any]:
        nodes, wiped, peers = CASES[case]
        for node in wiped:
            shutil.rmtree(self.local(node), ignore_errors=True)
        with open(os.path.join(self.root, "restore.digest"), "w"):
            pass
        self.cache.drop(self.root)
        t0 = time.time()
        self.ranks("restore", nodes, peers)
        with open(os.path.join(self.root, "restore.digest")) as f:
            if f.read() != self.saved_digest:
                raise SystemExit(f"{case}: the restored state differs from the saved one")
        seconds, fetched, received = [], {}, {}
        for node in sorted(set(nodes)):
            evs = [e for e in read_jsonl(os.path.join(self.local(node), RUN, "events.jsonl"))
                   if e.get("event") == "restore" and e.get("t", 0) >= t0]
            if len(evs) != nodes.count(node):
                raise SystemExit(f"{case}: {len(evs)} restore events on {node}, expected {nodes.count(node)}")
            seconds += [e["seconds"] for e in evs]
            got = max(e["fetched_bytes"] for e in evs)  # the leader's event carries its domain's bytes
            if got:
                fetched[node] = got
            if max(e["peer_bytes"] for e in evs):
                received[node] = max(e["peer_bytes"] for e in evs)
        if sorted(received if peers else fetched) != sorted(wiped) or (peers and fetched):
            raise SystemExit(f"{case}: nodes {sorted(fetched)} fetched, {sorted(received)} copied from a partner, "
                             f"expected {sorted(wiped)} to {'copy from a partner' if peers else 'fetch'}")
        return {"restore_s": max(seconds), "fetched": fetched, "received": received}

    def copy_baseline(self, node: str) -> float:
        """A plain copy of what ``node`` fetched in the last round, from the durable tier into an empty
        directory, after a cache drop: its whole files (read, write, fsync each), and of the files it took
        in part the same byte ranges (``pread`` of the ranges the fetch requested, written at their offsets)."""
        step_local = os.path.join(self.local(node), RUN, f"step_{1:012d}")
        names = sorted(f for f in os.listdir(step_local) if f.endswith(".distcp"))
        held = partial_items(read_manifest_file(os.path.join(step_local, "manifest.json")))
        src = os.path.join(self.durable, RUN, f"step_{1:012d}")
        dest = os.path.join(self.root, "copy")
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        self.cache.drop(self.root)
        t0 = time.perf_counter()
        for n in names:
            shutil.copyfile(os.path.join(src, n), os.path.join(dest, n))
            fd = os.open(os.path.join(dest, n), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        for n, items in held.items():
            fin = os.open(os.path.join(src, n), os.O_RDONLY)
            fout = os.open(os.path.join(dest, n), os.O_WRONLY | os.O_CREAT, 0o600)
            for g in coalesce([Span(o, k, "") for o, k in sorted(items)]):
                os.pwrite(fout, os.pread(fin, g[-1].end - g[0].offset, g[0].offset), g[0].offset)
            os.fsync(fout)
            os.close(fout)
            os.close(fin)
        dt = time.perf_counter() - t0
        shutil.rmtree(dest, ignore_errors=True)
        return dt

    def run(self) -> dict[str, Any]:
        r: dict[str, Any] = {"machine": machine_facts(self.root), "git": git_facts(), "mib": self.args.mib,
                             "cache": self.cache.note, "cases": {c: [] for c in CASES}}
        try:
            log(f"saving {self.args.mib} MiB at 4 ranks on n1, n2 and draining both nodes")
            r["saved"] = self.save()
            for i in range(self.args.repeats):
                for case in CASES:
                    got = self.restore(case)
                    got["copy_s"] = {n: self.copy_baseline(n) for n in got["fetched"]}
                    r["cases"][case].append(got)
                    log(f"round {i + 1} {case}: restore {got['restore_s']:.2f} s, fetched "
                        f"{ {n: round(b / 2**20, 1) for n, b in got['fetched'].items()} } MiB, from a partner "
                        f"{ {n: round(b / 2**20, 1) for n, b in got['received'].items()} } MiB, plain copy "
                        f"{ {n: round(s, 2) for n, s in got['copy_s'].items()} } s")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        return r


def report(r: dict[str, Any]) -> None:
    step = r["saved"]["step_bytes"]
    print(f"\nFSDP2 MLP + Adam, {r['mib']} MiB asked ({step / 2**20:.1f} MiB in {len(r['saved']['files'])} files), saved "
          f"at 4 ranks on n1, n2; POSIX durable tier on this machine's disk; cache: {r['cache']}. Medians of "
          f"{len(next(iter(r['cases'].values())))} rounds.\n")
    print("| case | restore | fetched (or copied from a partner) per node | of the step | before: every file | plain copy of the same files | restore / (local restore + copy) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    local = med([x["restore_s"] for x in r["cases"]["local"]])
    for case, runs in r["cases"].items():
        t = med([x["restore_s"] for x in runs])
        moved = "received" if runs[0].get("received") else "fetched"
        if not runs[0][moved]:
            print(f"| {case} | {fmt(t, '.2f', ' s')} | - | - | - | - | - |")
            continue
        per_node = {n: med([x[moved][n] for x in runs]) for n in runs[0][moved]}
        shown = ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in per_node.items()) + (
            " from the partner, 0 from the durable tier" if moved == "received" else "")
        frac = ", ".join(f"{b / step:.2f}" for b in per_node.values())
        before = ("the same (its own files)" if case.startswith("node wiped") else f"{step / 2**20:.1f} MiB per node")
        if moved == "received":  # against the same case from the durable tier, run in the same rounds
            durable = med([x["restore_s"] for x in r["cases"][case.split(",")[0]]])
            print(f"| {case} | {fmt(t, '.2f', ' s')} | {shown} | {frac} | {before} | - | "
                  f"{fmt(t / durable if t and durable else None, '.2f')} of the durable fetch |")
            continue
        copy = max(med([x["copy_s"][n] for x in runs]) or 0.0 for n in per_node)
        base = (local or 0.0) + copy
        print(f"| {case} | {fmt(t, '.2f', ' s')} | {shown} | {frac} | {before} | "
              f"{copy:.2f} s | {fmt(t / base if t and base else None, '.2f')} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    ap.add_argument("--json", default=None)
    add_wait_quiet_arg(ap)
    run_main(ap.parse_args(), Bench, report)  # type: ignore[arg-type]  # a Bench of its own, not a BenchBase

if __name__ == "__main__":
    main()
