"""Run a command with a CPU and I/O hog on every core beside it, as on a busy node; ``make test-load``.

    python tests/under_load.py [--runs N] [--cpu N] [--io N] [--dir DIR] -- CMD ...

Starts ``--cpu`` CPU hogs (default: one per core; each spins in pure Python) and ``--io`` I/O hogs (default:
one per core; each writes 8 MiB, fsyncs it, reads it back without the page cache's help where it can, and
deletes it, in a loop, in a directory of its own under ``--dir``, default the system's temporary directory),
all at the default priority, so they compete with the command for every core and for the disk as other
jobs' data loaders and checkpoints would. Then it runs ``CMD`` ``--runs`` times in a row (default 1),
stopping at the first run that fails, and stops the hogs (each by its pid, with its own process group)
whatever happens. It prints the load average at the start and end of each run, and exits with the
command's exit status (the first failing run's).

Races that only show on a busy machine (a timer that fires before another, a process scheduled seconds
late) are what this is for: run the launcher, attribution, orphan and Slurm tests under it before a
change to the launcher lands (docs/testing.md). It is not part of ``make test``: it takes several times
as long.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

CHUNK = 8 << 20


def _cpu_hog() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _io_hog(directory: str) -> None:
    data = os.urandom(CHUNK)
    path = os.path.join(directory, f"hog.{os.getpid()}")
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read it from the disk, not the cache
            while os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)
        os.unlink(path)


def _die_with_parent() -> None:
    """In the hog, before it runs: SIGKILL when this runner dies (even by SIGKILL), so no hog outlives it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _start(kind: str, directory: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, __file__, f"--hog={kind}", "--dir", directory],
                            start_new_session=True, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def _stop(hogs: list[subprocess.Popen[bytes]]) -> None:
    for h in hogs:
        if h.poll() is None:
            os.killpg(h.pid, signal.SIGKILL)  # its own group: only the hog (and nothing it forked)
    for h in hogs:
        h.wait()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=1, help="run the command this many times in a row")
    ap.add_argument("--cpu", type=int, default=os.cpu_count() or 1, help="CPU hogs (default: one per core)")
    ap.add_argument("--io", type=int, default=os.cpu_count() or 1, help="I/O hogs (default: one per core)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the I/O hogs write")
    ap.add_argument("--hog", choices=("cpu", "io"), help=argparse.SUPPRESS)
    if "--" in args:
        i = args.index("--")
        opts, cmd = args[:i], args[i + 1:]
    else:
        opts, cmd = args, []
    ns = ap.parse_args(opts)
    if ns.hog == "cpu":
        _cpu_hog()
    if ns.hog == "io":
        _io_hog(ns.dir)
    if not cmd:
        ap.error("no command given: under_load.py [options] -- CMD ...")
    if ns.runs < 1 or ns.cpu < 0 or ns.io < 0:
        ap.error("--runs must be >= 1, --cpu and --io >= 0")
    directory = tempfile.mkdtemp(prefix="rslurm-load-", dir=ns.dir)
    hogs: list[subprocess.Popen[bytes]] = []
    code = 0
    try:
        hogs += [_start("cpu", directory) for _ in range(ns.cpu)]
        hogs += [_start("io", directory) for _ in range(ns.io)]
        print(f"under_load: {ns.cpu} CPU and {ns.io} I/O hogs (pids {' '.join(str(h.pid) for h in hogs)}) "
              f"beside: {' '.join(cmd)}", flush=True)
        for run in range(1, ns.runs + 1):
            t0 = time.monotonic()
            print(f"under_load: run {run} of {ns.runs}, load average {_load()}", flush=True)
            code = subprocess.call(cmd)
            print(f"under_load: run {run} of {ns.runs} exited {code} after {time.monotonic() - t0:.0f} s, "
                  f"load average {_load()}", flush=True)
            if code != 0:
                break
    finally:
        _stop(hogs)
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
