"""resilient_slurm: checkpoint-and-recovery for PyTorch training on Slurm.

Public names are imported lazily (PEP 562): tools that only need the control socket, the manifest or
the CLI's argument parsing do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": ".checkpoint.checkpointer",
    "ResumableSampler": ".checkpoint.sampler",
    "protect_dataloader": ".checkpoint.workers",
    "init_distributed": ".distributed",
    "ResilientSlurmError": ".errors",
    "ConfigError": ".errors",
    "CheckpointError": ".errors",
    "SaveError": ".errors",
    "InsufficientSpaceError": ".errors",
    "CorruptCheckpointError": ".errors",
    "IncompatibleCheckpointError": ".errors",
    "RestoreUnavailableError": ".errors",
}

__all__ = [
    "Checkpointer",
    "ResumableSampler",
    "protect_dataloader",
    "init_distributed",
    "ResilientSlurmError",
    "ConfigError",
    "CheckpointError",
    "SaveError",
    "InsufficientSpaceError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "RestoreUnavailableError",
    "__version__",
]

if TYPE_CHECKING:
    from .checkpoint.checkpointer import Checkpointer
    from .checkpoint.sampler import ResumableSampler
    from .checkpoint.workers import protect_dataloader
    from .distributed import init_distributed
    from .errors import (
        CheckpointError,
        ConfigError,
        CorruptCheckpointError,
        IncompatibleCheckpointError,
        InsufficientSpaceError,
        ResilientSlurmError,
        RestoreUnavailableError,
        SaveError,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient_slurm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
