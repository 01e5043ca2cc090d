"""resilient_slurm: checkpoint-and-recovery for PyTorch training on Slurm."""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint.checkpointer import Checkpointer  # noqa: E402
from .checkpoint.sampler import ResumableSampler  # noqa: E402
from .distributed import init_distributed  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    InsufficientSpaceError,
    ResilientSlurmError,
    SaveError,
)

__all__ = [
    "Checkpointer",
    "ResumableSampler",
    "init_distributed",
    "ResilientSlurmError",
    "ConfigError",
    "CheckpointError",
    "SaveError",
    "InsufficientSpaceError",
    "CorruptCheckpointError",
    "IncompatibleCheckpointError",
    "__version__",
]
