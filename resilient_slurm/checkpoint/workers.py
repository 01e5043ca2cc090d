"""Keep DataLoader worker processes alive through the signals that ask for an emergency save.

Slurm signals every process of a job step, not only the rank: at preemption without ``--signal`` (and
for ``scancel --signal``), each DataLoader worker gets the same SIGTERM or save signal as its rank.
PyTorch workers die on a SIGTERM that their parent did not send, and the rank then raises "DataLoader
worker ... is killed by signal: Terminated" at its next batch, before it could save. So workers ignore
those signals: the rank decides, saves, and then shuts its workers down (a worker also exits by itself
once its rank is gone, and Slurm's SIGKILL at the end of the job reaches every process anyway).

Who calls what: :meth:`ResumableSampler.track` calls :func:`protect_dataloader` on its loader before
creating the iterator; programs with their own sampler call it once on each DataLoader.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

_IGNORED = ("SIGTERM", "SIGUSR1", "SIGUSR2")


def _signals_to_ignore() -> list[int]:
    names = list(_IGNORED)
    save = os.environ.get("RSLURM_SAVE_SIGNAL", "").strip().upper()
    if save and save not in ("NONE", "OFF"):
        names.append(save if save.startswith("SIG") else "SIG" + save)
    out = []
    for n in names:
        num = getattr(signal, n, None)
        if num is not None and num not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            out.append(int(num))
    return sorted(set(out))


class WorkerSignalShield:
    """A ``worker_init_fn`` that makes the worker ignore stop signals, then runs the program's own
    ``worker_init_fn`` (if any). A top-level class, so it pickles for the spawn start method."""

    def __init__(self, inner: Callable[[int], Any] | None = None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        for sig in _signals_to_ignore():
            signal.signal(sig, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def protect_dataloader(loader: Any) -> Any:
    """Make ``loader``'s worker processes ignore stop signals (idempotent); returns the loader.

    A loader that wraps another and iterates it (Accelerate's prepared loaders: ``base_dataloader``) has its
    workers started by the wrapped one, whose ``worker_init_fn`` they run: that one is protected too."""
    if getattr(loader, "num_workers", 0) and not isinstance(loader.worker_init_fn, WorkerSignalShield):
        loader.worker_init_fn = WorkerSignalShield(loader.worker_init_fn)
    base = getattr(loader, "base_dataloader", None)
    if base is not None and base is not loader:
        protect_dataloader(base)
    return loader
