"""Named fault-injection points for crash-consistency tests (off unless RSLURM_FAILPOINTS is set).

``RSLURM_FAILPOINTS="after_shard_write=kill,before_commit_rename=raise"`` makes the process SIGKILL
itself (``kill``), stop itself with SIGSTOP (``stop``: a rank that hangs, every thread of it) or raise an
OSError (``raise``) when it reaches that point; ``unlink`` removes the file
the point names (``after_shard_write``: the shard just written, as if it had gone to another directory or
been lost); ``flip`` inverts the first byte of the data the point passes (``during_range_fetch``: bytes
damaged on the wire), once per process. ``phase:<name>=raise`` makes every cross-rank phase whose name
starts with ``<name>`` fail on this rank (checkpoint/coordination.py; tests/test_phases.py). Points are named after the step of the commit protocol they follow, so a test can crash a
save at every step and check that every previously committed step survives. Set for one rank only, they
inject a fault on that rank. Checked once per point per process; costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "RSLURM_FAILPOINTS"

POINTS = (
    "before_shard_write",  # tmp dir created, nothing written
    "during_waves",  # a save staged in waves (staging_memory_limit): the first window written, the rest not
    "after_shard_write",  # this rank's shard fsynced, before the gather
    "after_dcp_metadata",  # leader: .metadata written in the tmp dir
    "after_manifest",  # leader: manifest.json written in the tmp dir, not yet renamed
    "after_commit_rename",  # leader: step_X/ in place, before retention
    "during_retention",  # any step deletion (layout.delete_step): uncommitted (renamed), not yet removed
    "during_peer_send",  # a peer replica round (checkpoint/peers.py): the first piece sent, the rest not
    "during_range_fetch",  # storage/tier.py get_ranges: one request's bytes arrived, not yet checked
    "gc_before_age",  # rslurm gc: a temp directory listed, its age not yet measured (unlink: its writer
    # committed or removed it meanwhile)
)


ACTIONS = ("kill", "stop", "raise", "unlink", "flip")
PHASE = "phase:"  # "phase:<start of a phase's name>=raise": that cross-rank phase fails on this rank (coordination.py)


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = part.partition("=")
        if name.startswith(PHASE) and len(name) > len(PHASE) and action == "raise":
            out[name] = action
            continue
        if name not in POINTS or action not in ACTIONS:
            raise ValueError(f"{ENV}: bad entry {part!r}; points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)}")
        out[name] = action
    return out


_ACTIVE = _parse(os.environ.get(ENV, ""))


def hit_phase(name: str) -> None:
    """Raise OSError when a ``phase:`` point armed here names the start of phase ``name``."""
    for point in _ACTIVE:
        if point.startswith(PHASE) and name.startswith(point[len(PHASE):]):
            raise OSError(f"failpoint {point} triggered")


def arm(spec: str) -> None:
    """Arm the points of ``spec`` (the syntax of RSLURM_FAILPOINTS) in this process from now on: a test's
    program faulting one of its ranks at one moment."""
    _ACTIVE.update(_parse(spec))


def armed(name: str) -> bool:
    """Whether the failpoint ``name`` is armed (a caller that must prepare what the point acts on)."""
    return name in _ACTIVE


def hit(name: str, path: str | None = None, data: bytearray | None = None) -> None:
    """Trigger the failpoint ``name`` if it is armed (``path``: the file an ``unlink`` removes; ``data``: the
    bytes a ``flip`` damages)."""
    action = _ACTIVE.get(name)
    if action == "flip" and data and _ACTIVE.pop(name, None) == "flip":  # once: fetched again, the bytes arrive intact
        data[0] ^= 0xFF
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "raise":
        raise OSError(f"failpoint {name} triggered")
    elif action == "unlink" and path is not None:
        if os.path.isdir(path) and not os.path.islink(path):
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
