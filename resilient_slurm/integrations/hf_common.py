"""What the Hugging Face integrations share (hf_trainer.py, hf_accelerate.py): the lazy framework import,
the objects Accelerate wraps, the sampler under a prepared loader."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ..checkpoint.checkpointer import Checkpointer
from ..errors import ConfigError


def require(module: str) -> ModuleType:
    """Import a framework, or say which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"resilient_slurm.integrations.hf needs {module} ({exc}): "
                          f"pip install 'resilient_slurm[hf]'") from exc


def inner(obj: Any, attr: str) -> Any:
    """The object Accelerate wraps (``AcceleratedOptimizer.optimizer``, ``AcceleratedScheduler.scheduler``):
    the one whose ``state_dict()`` keys its state by parameter index, as a plain optimizer does."""
    return getattr(obj, attr, obj)


def given_checkpointer(checkpointer: Checkpointer | None, kwargs: Mapping[str, Any]) -> Checkpointer | None:
    if checkpointer is not None and kwargs:
        raise ConfigError(f"pass either checkpointer= or the Checkpointer's arguments, not both "
                          f"(got {sorted(kwargs)})")
    return checkpointer


def sampler_of(loader: Any) -> Any:
    """The index sampler under a (prepared) loader's batch samplers. With several processes Accelerate wraps the
    loader's BatchSampler in a BatchSamplerShard (``.batch_sampler``), where its own ``get_sampler`` finds
    nothing."""
    cur = getattr(loader, "batch_sampler", None)
    for _ in range(8):
        if cur is None:
            break
        inner = getattr(cur, "sampler", None)
        if inner is not None:
            return getattr(inner, "sampler", inner) if hasattr(inner, "batch_size") else inner
        cur = getattr(cur, "batch_sampler", None)
    return getattr(loader, "sampler", None)
