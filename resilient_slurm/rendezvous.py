"""Where the ranks of a job meet: the rendezvous address rule, and the checks that name what went wrong.

The rule (the design's "Rendezvous on Slurm"): the rendezvous address is an address of the node that runs
task 0 as Slurm knows it, its ``NodeAddr``; the node's name only where that name resolves; a
``MASTER_ADDR`` the user set is kept. Slurm's node names need not be host names (``NodeName=gpu-st-1
NodeAddr=10.0.3.7`` on cloud clusters): the name is what Slurm prints everywhere, the address is what
connects.

Who applies it:

* the launcher (``rslurm launch -- srun``), to every node of the allocation at once: one
  ``scontrol show node`` (``SlurmClient.node_addresses``), then :func:`rendezvous_address` per node;
  :func:`encode_node_addresses` hands the result to the task prolog (``launcher/task_env.sh``) in
  :data:`NODE_ADDRS_VAR`, and the prolog exports ``MASTER_ADDR`` for the first node of each step;
* ``init_distributed()`` outside the launcher, for the one node of task 0 (:func:`slurm_node_addr`);
* both, when the ranks do not meet: :func:`resolve_error` and :func:`probe` say what did not resolve or
  connect, for the message.

Standard library only: the lower layers use it.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping

log = logging.getLogger(__name__)

# The launcher's node-name -> address map for the task prolog: "n1=10.0.0.1 n2=10.0.0.2 n3=". Only nodes
# whose address differs from their name are listed; an empty address means "no address works": the
# prolog then exports no MASTER_ADDR. Outside the RSLURM_ namespace on purpose (settings reject unknown
# RSLURM_* variables, and this is no setting); the prolog unsets it for the task.
NODE_ADDRS_VAR = "_RSLURM_NODE_ADDRS"
# One environment string may not exceed 128 KiB (Linux's MAX_ARG_STRLEN); keep well below it.
NODE_ADDRS_MAX = 64 << 10
# What the task prolog (POSIX sh, split on spaces and '=') can carry: host names, IPv4 and IPv6 addresses.
_SAFE = re.compile(r"^[A-Za-z0-9._:%-]+$")

SCONTROL_TIMEOUT_S = 10.0
RESOLVE_TRIES = 3  # a name server that answers "try again" (EAI_AGAIN) gets this many tries, a second apart


def resolve_error(host: str, *, tries: int = RESOLVE_TRIES, sleep: Callable[[float], None] = time.sleep) -> str | None:
    """None when ``host`` resolves here (``getaddrinfo``), else why not (``Name or service not known``)."""
    for attempt in range(max(1, tries)):
        try:
            socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            return None
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN and attempt + 1 < tries:
                sleep(1.0)
                continue
            return exc.strerror or str(exc)
        except (UnicodeError, ValueError) as exc:  # an empty label, a name too long for IDNA
            return str(exc)
    return "no answer from the name server"  # pragma: no cover - the loop returns


def rendezvous_address(node: str, node_addr: str | None,
                       resolve: Callable[[str], str | None] = resolve_error) -> str | None:
    """The rendezvous address of ``node``, the node of task 0: its ``NodeAddr`` when Slurm gave one, else its
    name where the name resolves (``resolve`` is :func:`resolve_error`), else None (no address works)."""
    if node_addr:
        return node_addr
    return node if resolve(node) is None else None


def encode_node_addresses(addrs: Mapping[str, str | None], *, limit: int = NODE_ADDRS_MAX) -> tuple[str, list[str]]:
    """The value of :data:`NODE_ADDRS_VAR` for ``addrs`` (node -> its rendezvous address, None: none works),
    in the allocation's order, and the nodes left out: those listed under their own name (the prolog
    falls back to the name), and those past ``limit`` bytes or that the prolog could not carry (the
    caller warns about those)."""
    parts: list[str] = []
    size = 0
    left_out: list[str] = []
    for node, addr in addrs.items():
        if addr == node:
            continue
        if not _SAFE.match(node) or (addr and not _SAFE.match(addr)):
            left_out.append(node)
            continue
        item = f"{node}={addr or ''}"
        if size + len(item) + 1 > limit:
            left_out.append(node)
            continue
        parts.append(item)
        size += len(item) + 1
    return " ".join(parts), left_out


def decode_node_addresses(text: str) -> dict[str, str]:
    """:func:`encode_node_addresses`'s value back as node -> address ("" for none)."""
    out: dict[str, str] = {}
    for item in text.split():
        node, sep, addr = item.partition("=")
        if sep and node:
            out[node] = addr
    return out


_RECORD_FIELD = re.compile(r"(?:^|\s)(NodeName|NodeAddr)=(\S*)")


def node_addrs_from_records(text: str) -> dict[str, str]:
    """``NodeName`` -> ``NodeAddr`` from ``scontrol show node -o`` output (one record a line). A node without
    an address (``NodeAddr=`` empty, ``(null)``) is left out."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        fields: dict[str, str] = {m[1]: m[2] for m in _RECORD_FIELD.finditer(line)}
        name, addr = fields.get("NodeName"), fields.get("NodeAddr")
        if name and addr and addr not in ("(null)", "N/A", "None"):
            out[name] = addr
    return out


def slurm_node_addr(node: str, *, scontrol: str = "scontrol", timeout_s: float = SCONTROL_TIMEOUT_S) -> str | None:
    """``node``'s ``NodeAddr`` from ``scontrol show node -o NODE``; None (logged at debug level) when Slurm
    does not say: no scontrol, no controller, no such node. For ``init_distributed`` outside the
    launcher, which asks for one node (the launcher asks for all through ``SlurmClient.node_addresses``)."""
    try:
        cp = subprocess.run([scontrol, "show", "node", "-o", node], capture_output=True, text=True,
                            timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("scontrol show node %s: %s", node, exc)
        return None
    if cp.returncode != 0:
        log.debug("scontrol show node %s: exit %d: %s", node, cp.returncode, cp.stderr.strip()[:200])
        return None
    return node_addrs_from_records(cp.stdout).get(node)


def probe(host: str, port: int, *, timeout_s: float = 3.0) -> str | None:
    """None when a TCP connection to ``host:port`` opens from here, else what failed, in words:
    ``'x' does not resolve (...)``, ``nothing listens at x:p (connection refused)``, ``x:p did not answer
    within 3 s``."""
    why = resolve_error(host, tries=1)
    if why is not None:
        return f"{host!r} does not resolve ({why})"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"{host}:{port} did not answer within {timeout_s:.0f} s"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return f"nothing listens at {host}:{port} (connection refused)"
        return f"cannot connect to {host}:{port} ({exc.strerror or exc})"


# torch's c10d lines when a rank cannot reach the store, e.g.
#   [c10d] The IPv6 network addresses of (n1, 15001) cannot be retrieved (gai error: -2 - Name or service not known).
#   [c10d] The client socket has timed out after 8000ms while trying to connect to (n1, 15001).
#   [c10d] The client socket has failed to connect to [n1]:15001 (errno: 111 - Connection refused).
#   [c10d] TCP client failed to connect/validate to host n1:15001 - retrying (...)
_C10D_FAILURE = re.compile(r"^.*\[c10d\].*(?:cannot be retrieved|failed to connect|timed out|"
                           r"Connection refused|No route to host|Network is unreachable).*$", re.M)
_HOST_PORT = (re.compile(r"\((?P<host>[^,()\s]+), (?P<port>\d+)\)"),
              re.compile(r"\[(?P<host>[^\]\s]+)\]:(?P<port>\d+)"),
              re.compile(r"\bhost (?P<host>[^\s:]+):(?P<port>\d+)"))


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> range:
    """The kernel's ephemeral port range, from which outgoing connections take their local port (Linux's
    default 32768-60999 where ``path`` cannot be read)."""
    try:
        with open(path, encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port(ports: range, *, host: str = "", rng: random.Random | None = None) -> int:
    """A TCP port of ``ports`` that this process may bind on ``host`` now (``""``: every address, as
    torch's TCPStore listens), tried in random order, those outside the kernel's ephemeral range first.

    Binding port 0 would give an ephemeral port, which any outgoing connection (a gloo pair, an HTTP request)
    may take between the check and the listener's own bind: the listener then fails with EADDRINUSE, or its
    clients meet a stranger. A host whose ephemeral range covers all of ``ports`` (``1024 65535`` is a
    common tuning) still gets a port of ``ports``, and failing that one the kernel picks (port 0), with a
    warning: a start that may race is better than none."""
    ephemeral = ephemeral_ports()
    valid = [p for p in ports if 0 < p < 65536]
    chooser = rng or random.Random()
    clear = [p for p in valid if not ephemeral.start <= p < ephemeral.stop]
    inside = [p for p in valid if ephemeral.start <= p < ephemeral.stop]
    chooser.shuffle(clear)
    chooser.shuffle(inside)
    for port in [*clear, *inside, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen = int(sock.getsockname()[1])
        if port == 0 or port in inside:
            log.warning("no free TCP port in %d-%d outside the kernel's ephemeral range %d-%d: using %d, which an "
                        "outgoing connection may take before it is listened on", ports.start, ports.stop - 1,
                        ephemeral.start, ephemeral.stop - 1, chosen)
        return chosen
    raise OSError(errno.EADDRINUSE, f"no TCP port can be bound on {host or 'any address'}")


def rendezvous_failure_line(texts: Iterable[str]) -> tuple[str, str | None, int | None] | None:
    """The last line of torch's c10d that says a rank could not reach the store, in the first of ``texts``
    that has one (ranks' stderr), with the host and port it names; None when there is none."""
    for text in texts:
        lines = _C10D_FAILURE.findall(text)
        if not lines:
            continue
        line = lines[-1].strip()
        line = line[line.index("[c10d]"):] if "[c10d]" in line else line  # torch's own time and place prefix
        for pattern in _HOST_PORT:
            m = pattern.search(line)
            if m:
                return line[:400], m["host"], int(m["port"])
        return line[:400], None, None
    return None


__all__ = ["NODE_ADDRS_MAX", "NODE_ADDRS_VAR", "decode_node_addresses", "encode_node_addresses", "ephemeral_ports",
           "free_port", "node_addrs_from_records", "probe", "rendezvous_address", "rendezvous_failure_line", "resolve_error",
           "slurm_node_addr"]
