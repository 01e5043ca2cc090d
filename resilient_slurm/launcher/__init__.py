"""The launcher's building blocks: the requeue policy and the cloud termination notice watcher.

``policy`` is pure (no I/O); ``cloud`` polls instance metadata over HTTP with ``requests``. Neither imports
torch, so the launcher process stays light.
"""

from __future__ import annotations

from .cloud import Notice, TerminationNoticeWatcher
from .policy import (
    Action,
    Decision,
    HoldRule,
    MaxRestartsRule,
    NoProgressRule,
    Outcome,
    ProgressHistory,
    Reason,
    RequeuePolicy,
    traceback_location,
)

__all__ = [
    "Action", "Decision", "HoldRule", "MaxRestartsRule", "NoProgressRule", "Notice", "Outcome",
    "ProgressHistory", "Reason", "RequeuePolicy", "TerminationNoticeWatcher", "traceback_location",
]
