"""TCP ports for the tests' listeners: below the product's job-port range (15000-31999, where the Slurm test
jobs meet) and outside the kernel's ephemeral range, one slice per pytest-xdist worker.

A port from ``bind(('127.0.0.1', 0))`` is ephemeral: between the test's check and the listener's own bind,
any outgoing connection of another test (a gloo pair, an HTTP request) may take it. A CI run lost a rank
set that way (EADDRINUSE at rank 0, rank 1 waiting on a stranger for 300 s).
"""

from __future__ import annotations

import os

from resilient_slurm.rendezvous import free_port as _free_port

TEST_PORTS = range(8000, 15000)


def worker_ports() -> range:
    """This xdist worker's slice of :data:`TEST_PORTS` (the whole range outside xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    width = len(TEST_PORTS) // max(1, count)
    start = TEST_PORTS.start + (index % max(1, count)) * width
    return range(start, start + width)


def free_port() -> int:
    """A TCP port that is free on loopback now, from this worker's slice."""
    return _free_port(worker_ports())


def free_ports(n: int) -> list[int]:
    """``n`` distinct such ports."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
