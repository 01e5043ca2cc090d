"""Cost of the progress heartbeat on the training thread (``ckpt.step()`` -> ``HeartbeatWriter.beat``).

    python bench/bench_heartbeat.py [--calls N] [--repeats R]

Baselines measured in the same run: an empty Python method call (the floor of any per-step hook) and
one control-socket poll (what ``ckpt.step()`` already pays every ``sync_every`` steps when the launcher's
socket is up). Prints the median per-call time of each over R repeats and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from resilient_slurm.control import ControlClient, ControlServer  # noqa: E402
from resilient_slurm.control.heartbeat import HeartbeatWriter, heartbeat_path, read_heartbeats  # noqa: E402


class _Nop:
    def beat(self, step: int) -> None:
        pass


def _per_call(fn: object, calls: int) -> float:
    beat = fn.beat  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for i in range(calls):
        beat(i)
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        sock = os.path.join(d, "bench.n1.sock")
        writer = HeartbeatWriter(heartbeat_path(sock, 0))
        nop = _Nop()
        beat = [_per_call(writer, args.calls) for _ in range(args.repeats)]
        empty = [_per_call(nop, args.calls) for _ in range(args.repeats)]
        read = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(1000):
                read_heartbeats(sock)
            read.append((time.perf_counter() - t0) / 1000)
        server = ControlServer(sock + ".ctl")
        server.start()
        try:
            client = ControlClient(sock + ".ctl", timeout=2.0)
            client.hello(0, 0, step=0)
            polls = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for i in range(2000):
                    client.poll(0, i)
                polls.append((time.perf_counter() - t0) / 2000)
            client.close()
        finally:
            server.stop()
        writer.close()
    b, e, p, r = (statistics.median(x) for x in (beat, empty, polls, read))
    print(f"heartbeat beat():        {b * 1e6:8.3f} us per step (median of {args.repeats} x {args.calls})")
    print(f"empty method call:       {e * 1e6:8.3f} us   -> beat() costs {b / e:.1f}x an empty call")
    print(f"control socket poll:     {p * 1e6:8.3f} us   -> beat() is {p / b:.0f}x cheaper than one poll")
    print(f"launcher read (1 rank):  {r * 1e6:8.3f} us per read_heartbeats() (once a second)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
