#!/usr/bin/env python3
"""Peer replicas while training: the extra stall (goal: none) and the background bandwidth (issue 14, item 3).

Two ranks on two emulated nodes (n1, n2: ``RSLURM_NODE_NAME``, each its own local directory on this
machine's disk) train a DDP-wrapped transformer-shaped model with Adam (bench/peer_worker.py, gloo on CPU;
a step is a wait of ``--step-ms``, as the CPU of a GPU job is free while the GPU trains) and save every
``--every`` steps, with ``peer_replicas=off`` and ``=auto`` in alternating order each round. Each node's
domain writes the whole state (DDP state is replicated: once per node), and with peers each node's leader
then sends that step to the other node and keeps the other's, on the writer thread.

Measured from the ranks' own events and step times, medians over rounds:

- the save's stall (``save_staged.stall_s``: what the training thread waited), off and on;
- the step time of the steps after a save (when the replica round runs) and of all steps, off and on;
- a replica round: its time (median over the run's rounds; the first rounds of a run are slower, as the
  kernel first hands out page cache for new files) and bytes each way, hence the bandwidth it used, and
  the average bandwidth over the run (bytes per save over the save interval);
- baselines in the same run: a plain copy of the node's step files (read, write, fsync) on this disk, and
  a raw TCP transfer of as many bytes over loopback (one socket, ``sendall``/``recv_into``).

Usage::

    .venv/bin/python bench/bench_peers.py [--mib 256] [--steps 60] [--every 10] [--step-ms 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

from common import (  # noqa: E402
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

RUN = "peerbench"
WORKER = os.path.join(HERE, "peer_worker.py")
NODES = ["n1", "n2"]


def tcp_loopback(nbytes: int) -> float:
    """Seconds to move ``nbytes`` over one loopback TCP connection (64 MiB writes, read into a buffer)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while got[0] < nbytes:
            n = conn.recv_into(view)
            if not n:
                break
            got[0] += n
        conn.close()

    th = threading.Thread(target=sink)
    th.start()
    payload = os.urandom(1 << 20) * 64
    c = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, len(payload))
        c.sendall(memoryview(payload)[:n])
        left -= n
    c.shutdown(socket.SHUT_WR)
    th.join()
    dt = time.perf_counter() - t0
    c.close()
    srv.close()
    return dt


def disk_copy(src: str, dest: str) -> float:
    """Seconds to copy every file of ``src`` into an empty ``dest`` and fsync each."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    t0 = time.perf_counter()
    for n in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, n), os.path.join(dest, n))
        fd = os.open(os.path.join(dest, n), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    dt = time.perf_counter() - t0
    shutil.rmtree(dest, ignore_errors=True)
    return dt


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = scratch_dir(args.dir, "rslurm-bench-peers-")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RSLURM_", "SLURM_"))}
        self.env.update({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RSLURM_AUTO_CADENCE": "off",
                         "RSLURM_CONTROL_SOCKET": "off", "RSLURM_LOG_LEVEL": "WARNING",
                         "RSLURM_COLLECTIVE_TIMEOUT": "300", "RSLURM_KEEP_LAST": "2"})

    def train(self, mode: str) -> dict[str, Any]:
        work = os.path.join(self.root, mode)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        a = self.args
        port = free_port()
        procs = []
        for r, node in enumerate(NODES):
            env = {**self.env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RSLURM_NODE_NAME": node,
                   "RSLURM_PEER_REPLICAS": mode}
            out = open(os.path.join(work, f"rank{r}.log"), "w")
            procs.append((subprocess.Popen(
                [sys.executable, WORKER, "--mib", str(a.mib), "--steps", str(a.steps), "--every", str(a.every),
                 "--step-ms", str(a.step_ms), "--local-dir", os.path.join(work, "nvme", "%n"), "--run-id", RUN,
                 "--out", work], env=env, stdout=out, stderr=subprocess.STDOUT), out))
        codes = []
        for p, out in procs:
            codes.append(p.wait(timeout=1800))
            out.close()
        if any(codes):
            logs = "".join(open(os.path.join(work, f"rank{r}.log")).read()[-3000:] for r in range(2))
            raise SystemExit(f"{mode}: ranks failed: {codes}\n{logs}")
        steps = [json.load(open(os.path.join(work, f"steps.{r}.json"))) for r in range(2)]
        events = [e for n in NODES for e in read_jsonl(os.path.join(work, "nvme", n, RUN, "events.jsonl"))]
        stalls = [e["stall_s"] for e in events if e["event"] == "save_staged"]
        rounds = [e for e in events if e["event"] == "peer_replica"]
        after = [t[i] for t in steps for i in range(len(t)) if i % a.every < a.every // 2 and i >= a.every]
        newest = max(int(d[5:]) for d in os.listdir(os.path.join(work, "nvme", "n1", RUN)) if d.startswith("step_"))
        step_dir = os.path.join(work, "nvme", "n1", RUN, f"step_{newest:012d}")
        node_bytes = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
        got: dict[str, Any] = {
            "stall_s": med(stalls), "step_s": med([x for t in steps for x in t]), "after_save_step_s": med(after),
            "loop_s": max(sum(t) for t in steps), "node_bytes": node_bytes,
            "copy_s": disk_copy(step_dir, os.path.join(self.root, "copy")),
        }
        if mode != "off":
            if not rounds or any(e["problem"] for e in rounds):
                raise SystemExit(f"replica rounds missing or failed: {rounds}")
            full = [e for e in rounds if e["sent_bytes"]]
            got.update(round_s=med([e["seconds"] for e in full]), sent_bytes=med([e["sent_bytes"] for e in full]),
                       rounds=len(full))
        shutil.rmtree(work, ignore_errors=True)
        return got

    def run(self) -> dict[str, Any]:
        a = self.args
        r: dict[str, Any] = {"machine": machine_facts(self.root), "git": git_facts(), "mib": a.mib, "steps": a.steps,
                             "every": a.every, "step_ms": a.step_ms, "off": [], "auto": [], "tcp_s": []}
        try:
            for i in range(max(1, a.repeats)):
                for mode in (("off", "auto") if i % 2 == 0 else ("auto", "off")):
                    got = self.train(mode)
                    r[mode].append(got)
                    log(f"round {i + 1} peer_replicas={mode}: stall {got['stall_s']:.3f} s, step {got['step_s']:.3f} s, "
                        f"after a save {got['after_save_step_s']:.3f} s, loop {got['loop_s']:.1f} s"
                        + (f", replica round {got['round_s']:.2f} s for {got['sent_bytes'] / 2**20:.0f} MiB"
                           if mode != "off" else ""))
                r["tcp_s"].append(tcp_loopback(r["auto"][-1]["node_bytes"]))
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        return r


def report(r: dict[str, Any]) -> None:
    off, on = r["off"], r["auto"]

    def m(runs: list[dict[str, Any]], k: str) -> float | None:
        return med([x[k] for x in runs])

    node = m(on, "node_bytes") or 0.0
    print(f"\nDDP transformer-shaped model + Adam, {r['mib']} MiB asked ({node / 2**20:.1f} MiB per node's step), 2 ranks "
          f"on n1, n2 (one machine, one disk), {r['steps']} steps of {r['step_ms']:.0f} ms, a save every {r['every']} "
          f"steps; medians of {len(on)} rounds.\n")
    print("| | peer_replicas=off | auto | auto / off |")
    print("|---|---:|---:|---:|")
    for label, k, spec in (("save stall", "stall_s", ".3f"), ("step", "step_s", ".3f"),
                           ("step in the half interval after a save", "after_save_step_s", ".3f"),
                           ("training loop, slowest rank", "loop_s", ".1f")):
        a, b = m(off, k), m(on, k)
        print(f"| {label} | {fmt(a, spec, ' s')} | {fmt(b, spec, ' s')} | {fmt(b / a if a and b else None, '.2f')} |")
    rs, sent = m(on, "round_s"), m(on, "sent_bytes")
    copy, tcp = m(on, "copy_s"), med(r["tcp_s"])
    interval = r["every"] * r["step_ms"] / 1000
    print("\n| replica round (each node sends its step and receives the other's) | |")
    print("|---|---:|")
    if rs and sent:
        print(f"| bytes each way | {sent / 2**20:.1f} MiB |")
        print(f"| round time | {rs:.2f} s |")
        print(f"| bandwidth while it runs, each way | {sent / 2**20 / rs:.0f} MiB/s |")
        print(f"| average over the run, each way (per save interval of {interval:.1f} s) | "
              f"{sent / 2**20 / interval:.0f} MiB/s |")
    print(f"| baseline: plain copy of one node's step files on this disk (read, write, fsync) | {fmt(copy, '.2f', ' s')} |")
    print(f"| baseline: raw loopback TCP of as many bytes, one way | {fmt(tcp, '.2f', ' s')} |")
    if rs and copy:
        # Both nodes are on this machine: their two rounds read, send, receive and write both steps at once,
        # through one disk, so the like-for-like baseline is both copies, one after the other.
        print(f"| round / two plain copies (both nodes' rounds share this machine's disk) | {rs / (2 * copy):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--step-ms", type=float, default=200.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: the temporary directory)")
    ap.add_argument("--json", default=None)
    add_wait_quiet_arg(ap)
    run_main(ap.parse_args(), Bench, report)  # type: ignore[arg-type]  # a Bench of its own, not a BenchBase

if __name__ == "__main__":
    main()
