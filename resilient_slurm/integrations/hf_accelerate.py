"""Accelerate: a loop of your own on the :class:`Checkpointer` (:class:`AcceleratorCheckpointer`;
resilient_slurm/integrations/hf.py says how it saves and resumes)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import torch

from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.workers import protect_dataloader
from ..errors import CheckpointError, ConfigError
from .hf_common import given_checkpointer, inner, require, sampler_of

__all__ = ["AcceleratorCheckpointer"]


class AcceleratorCheckpointer:
    """A :class:`Checkpointer` for a loop that uses Accelerate (``accelerator.prepare``, ``backward``).

    Its state is everything ``accelerator.save_state`` would save: each prepared model (unwrapped),
    optimizer and scheduler, the scaler, the objects given to ``accelerator.register_for_checkpointing``,
    plus the RNG (the Checkpointer's capture) and the position of the loader iterated with
    :meth:`batches`. Objects prepared after it was built are included too (the state is read at each call).
    """

    def __init__(self, accelerator: Any, checkpointer: Checkpointer | None = None, *,
                 extra: Mapping[str, Any] | None = None, **checkpointer_kwargs: Any) -> None:
        """``checkpointer``: one you built, else one from ``checkpointer_kwargs`` (every Checkpointer
        argument). ``extra``: more state under your own keys (an EMA model, counters), as in a plain
        Checkpointer's state; after :meth:`restore`, read plain values back from :attr:`extra` (a restore
        replaces them, as it does in a plain Checkpointer's state)."""
        require("accelerate")
        self._given = given_checkpointer(checkpointer, checkpointer_kwargs)
        self.accelerator = accelerator
        self.extra: dict[str, Any] = dict(extra or {})
        clash = [k for k in self.extra if _OWN_KEYS.fullmatch(k)]
        if clash:
            raise ConfigError(f"extra keys {clash} clash with the keys of Accelerate's objects: rename them")
        self.ckpt = checkpointer if checkpointer is not None else Checkpointer(**checkpointer_kwargs)
        # The loader's position: its epoch and the batches of that epoch the loop received.
        self.position: dict[str, int] = {"epoch": 0, "batches": 0}

    @property
    def should_stop(self) -> bool:
        """True once an emergency checkpoint has committed: leave the loop (exit 0; the job is requeued)."""
        return self.ckpt.should_stop

    @property
    def epoch(self) -> int:
        """The epoch :meth:`batches` is in (the restored one after a resume)."""
        return self.position["epoch"]

    def state(self) -> dict[str, Any]:
        """The Checkpointer's state: Accelerate's objects under ``model``, ``model_1``, ``optimizer``, ...,
        ``scheduler``, ``scaler``, ``registered_<i>``, then ``position`` and your ``extra``."""
        acc = self.accelerator
        state: dict[str, Any] = {}
        for i, m in enumerate(acc._models):
            state["model" if i == 0 else f"model_{i}"] = acc.unwrap_model(m)
        for i, o in enumerate(acc._optimizers):
            state["optimizer" if i == 0 else f"optimizer_{i}"] = inner(o, "optimizer")
        for i, s in enumerate(acc._schedulers):
            state["scheduler" if i == 0 else f"scheduler_{i}"] = inner(s, "scheduler")
        if getattr(acc, "scaler", None) is not None:
            state["scaler"] = acc.scaler
        for i, obj in enumerate(acc._custom_objects):
            state[f"registered_{i}"] = obj
        state["position"] = self.position
        state.update(self.extra)
        return state

    def restore(self, **kwargs: Any) -> int:
        """Restore the newest committed step (``Checkpointer.restore``; keyword arguments go to it); return it."""
        state = self.state()
        step = self.ckpt.restore(state, **kwargs)
        self.position = {"epoch": int(state["position"]["epoch"]), "batches": int(state["position"]["batches"])}
        for k in self.extra:  # plain values are replaced in the state dict, not in place: read them back
            self.extra[k] = state[k]
        return step

    def batches(self, loader: Any, epochs: int) -> Iterator[Any]:
        """The loader's batches from the restored position to the end of epoch ``epochs - 1``.

        Each epoch calls ``loader.set_epoch(epoch)``; the resumed epoch skips the batches already received
        (``accelerator.skip_first_batches``: their indices are drawn, their samples are not loaded). A
        batch counts as received when this generator yields it, so the batches a DataLoader prefetched are
        not lost. Starting an epoch's iterator draws from the global torch RNG (the workers' base seed), at
        the epoch's start in a run that never stopped and mid-epoch in a resumed one: that draw runs on a
        forked RNG here, so dropout sees the same numbers in both. Stops early once :attr:`should_stop`."""
        self._check_loader(loader)
        protect_dataloader(loader)
        while self.position["epoch"] < epochs and not self.should_stop:
            epoch, skip = self.position["epoch"], self.position["batches"]
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            source = self.accelerator.skip_first_batches(loader, skip) if skip else loader
            it = iter(source)
            with torch.random.fork_rng(devices=[]):
                first = next(it, _END)  # Accelerate's loaders start their work at the first next()
            if first is not _END:
                self.position["batches"] += 1
                yield first
                for batch in it:
                    if self.should_stop:
                        return
                    self.position["batches"] += 1
                    yield batch
            if self.should_stop:
                return
            self.position["epoch"], self.position["batches"] = epoch + 1, 0

    @staticmethod
    def _check_loader(loader: Any) -> None:
        """A shuffling loader must draw each epoch's order from (seed, epoch): Accelerate's seedable sampler."""
        from torch.utils.data import RandomSampler  # noqa: PLC0415

        dl = require("accelerate.data_loader")
        sampler = sampler_of(loader)
        if isinstance(sampler, RandomSampler) and not isinstance(sampler, dl.SeedableRandomSampler):
            raise ConfigError("this loader shuffles with a generator whose state at an epoch's start is not saved, "
                              "so a resumed epoch would be shuffled in another order: build the Accelerator with "
                              "dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)")

    def step(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """``Checkpointer.step`` with this state: call it after each optimizer step, outside
        ``accelerator.accumulate`` micro-steps, with the number of optimizer steps completed."""
        self.ckpt.step(step, self.state(), metrics=metrics)

    def save(self, step: int, blocking: bool = True, *, reason: str = "manual") -> None:
        """``Checkpointer.save`` with this state."""
        self.ckpt.save(step, self.state(), blocking, reason=reason)

    def close(self, *, failed: bool = False) -> None:
        """Close the Checkpointer (unless it was given: then its owner closes it); ``failed`` as
        :meth:`Checkpointer.close`."""
        if self._given is None:
            self.ckpt.close(failed=failed)

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        with contextlib.suppress(CheckpointError):
            self.close(failed=True)


_END = object()
# The keys AcceleratorCheckpointer.state() gives Accelerate's objects and the loader's position.
_OWN_KEYS = re.compile(r"(model|optimizer|scheduler)(_\d+)?|scaler|registered_\d+|position")
