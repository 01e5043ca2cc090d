"""A run's names: every file and directory under ``<root>/<run_id>/`` on the node-local tier, the run's
lock in the root's state directory, and the run's keys on the durable tier, in one object.

The modules that own a file's *content* (telemetry: the event log; run_history and the launcher: the
history; tags; stragglers; checkpoint/metrics; control/heartbeat: stacks; layout: steps, temp directories,
replicas and the writer lock) take its *name* from here, so that a reader (``rslurm ls``, ``rehearse``,
the daemon's status) and the writer never disagree on it::

    <root>/<run_id>/step_<step:012d>/manifest.json   a committed step (manifest.py builds the names)
    <root>/<run_id>/events.jsonl                      EVENTS_FILE: the run's telemetry, one JSON object a line
    <root>/<run_id>/launcher-history.json             HISTORY_FILE: the launcher's incarnations (also durable)
    <root>/<run_id>/tags.json                         TAGS_FILE: tagged steps (also durable)
    <root>/<run_id>/stragglers.json                   STRAGGLERS_FILE: the latest straggler verdict
    <root>/<run_id>/stacks/rank<R>.txt                STACKS_DIR: stacks dumped at a hang (py-spy: .py-spy.txt)
    <root>/<run_id>/metrics/rank<R>.jsonl             METRICS_DIR: training metrics for the resume check
    <root>/<run_id>/replicas/<domain>/                REPLICAS_DIR: a partner domain's steps (peer replicas)
    <root>/.rslurm/run-<run_id>.lock                  the one-writer lock of the run (layout.claim_run)
    <root>/.rslurm/encode-<pid>/                      the daemon's compressed copies on their way (storage.encoding)

Pure names: nothing here touches the file system, so any layer may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .manifest import MANIFEST_NAME, durable_run_key, durable_step_key, step_dirname
from .paths import STATE_DIR

EVENTS_FILE = "events.jsonl"
HISTORY_FILE = "launcher-history.json"
TAGS_FILE = "tags.json"
STRAGGLERS_FILE = "stragglers.json"
STACKS_DIR = "stacks"
METRICS_DIR = "metrics"
REPLICAS_DIR = "replicas"
WRITER_LOCK = "run-{}.lock"  # in the root's state directory, formatted with the run id
ENCODE_SCRATCH = "encode-"  # + a daemon's pid, in the root's state directory: shards being compressed


@dataclass(frozen=True)
class RunDir:
    """The names of run ``run_id`` under the node-local root ``root``."""

    root: str
    run_id: str

    @classmethod
    def at(cls, path: str) -> RunDir:
        """The run whose directory is ``path`` (``<root>/<run_id>``)."""
        path = os.path.normpath(path)
        return cls(os.path.dirname(path), os.path.basename(path))

    @property
    def path(self) -> str:
        """``<root>/<run_id>``."""
        return os.path.join(self.root, self.run_id)

    def file(self, name: str) -> str:
        """``<root>/<run_id>/<name>``."""
        return os.path.join(self.root, self.run_id, name)

    def step(self, step: int) -> str:
        """The committed directory of ``step``."""
        return self.file(step_dirname(step))

    def manifest(self, step: int) -> str:
        """The manifest of ``step`` (it exists only once the step is committed)."""
        return os.path.join(self.step(step), MANIFEST_NAME)

    @property
    def events(self) -> str:
        return self.file(EVENTS_FILE)

    @property
    def history(self) -> str:
        return self.file(HISTORY_FILE)

    @property
    def tags(self) -> str:
        return self.file(TAGS_FILE)

    @property
    def stragglers(self) -> str:
        return self.file(STRAGGLERS_FILE)

    @property
    def stacks(self) -> str:
        return self.file(STACKS_DIR)

    def stack_file(self, rank: int) -> str:
        """Where rank ``rank`` writes its stacks (faulthandler) at a hang."""
        return os.path.join(self.stacks, f"rank{rank}.txt")

    @property
    def metrics(self) -> str:
        return self.file(METRICS_DIR)

    def metrics_file(self, rank: int) -> str:
        return os.path.join(self.metrics, f"rank{rank}.jsonl")

    @property
    def replicas(self) -> str:
        return self.file(REPLICAS_DIR)

    def replica(self, domain: str) -> str:
        """The run directory of partner ``domain``'s replicas (a run directory of its own for layout)."""
        return os.path.join(self.replicas, domain)

    @property
    def state_dir(self) -> str:
        """The root's state directory (private; the daemon's lock and status, the runs' writer locks)."""
        return os.path.join(self.root, STATE_DIR)

    def encode_scratch(self, pid: int) -> str:
        """Where daemon ``pid`` writes the compressed copies of shards it uploads (removed after each step)."""
        return os.path.join(self.state_dir, f"{ENCODE_SCRATCH}{pid}")

    @property
    def writer_lock_name(self) -> str:
        return WRITER_LOCK.format(self.run_id)

    def durable_key(self, name: str) -> str:
        """The key of a run-level object (``HISTORY_FILE``, ``TAGS_FILE``) on the durable tier."""
        return durable_run_key(self.run_id, name)

    def durable_step_key(self, step: int, *names: str) -> str:
        """The key of ``step`` (or of a file below it) on the durable tier."""
        return durable_step_key(self.run_id, step, *names)


__all__ = ["ENCODE_SCRATCH", "EVENTS_FILE", "HISTORY_FILE", "METRICS_DIR", "REPLICAS_DIR", "STACKS_DIR", "STRAGGLERS_FILE", "TAGS_FILE",
           "WRITER_LOCK", "RunDir"]
