"""Where a run's files live: node name, node-local root, run id. Standard library only, so the launcher
and the CLI can name a run's directory without importing torch."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Mapping


def node_name(explicit: str | None = None) -> str:
    """This process's node name: explicit > $SLURMD_NODENAME > hostname."""
    return explicit or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def expand_local_dir(template: str, node: str) -> str:
    """Expand ``%n`` (node name) and ``~`` in a local_dir template."""
    return os.path.abspath(os.path.expanduser(template.replace("%n", node)))


def default_local_dir() -> str:
    """Per-user directory under $TMPDIR, one sub-directory per node."""
    return os.path.join(tempfile.gettempdir(), f"rslurm-{os.getuid()}", "%n")


def default_run_id(env: Mapping[str, str] | None = None) -> str:
    """Slurm job id (``<array job>_<task>`` for array tasks); ``default`` outside Slurm."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or "default"
