"""Transformers' Trainer on the :class:`Checkpointer`: :func:`train` in place of ``trainer.train()``, and the
:class:`RslurmCallback` it adds (resilient_slurm/integrations/hf.py says how it saves and resumes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from ..checkpoint import rng
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.workers import protect_dataloader
from ..errors import CheckpointError, ConfigError, IncompatibleCheckpointError
from .hf_common import given_checkpointer, inner, require

log = logging.getLogger(__name__)

__all__ = ["RslurmCallback", "train"]

# The key of the JSON string that holds the Trainer's own state and its scheduler's.
TRAINER_KEY = "trainer"
# The key of the RNG state from before the look-ahead fetch of the step after the saved one (_FetchRng).
FETCH_RNG_KEY = "fetch_rng"
STATE_VERSION = 1


class RslurmCallback:
    """A Trainer callback that saves through a :class:`Checkpointer` at every step boundary.

    Use :func:`train` (or :meth:`train`): the resume needs a step before ``trainer.train()`` starts, which
    a callback cannot take. ``record_loss`` records each step's training loss (the sum of its micro-batch
    losses) as the metric ``loss`` (``rslurm rehearse`` compares it; on a GPU it costs one ``.item()``
    per step, a wait for the GPU). Every other hook is a no-op, whatever hooks the Trainer has.
    """

    def __init__(self, checkpointer: Checkpointer | None = None, *, record_loss: bool = True,
                 resume_dir: str | None = None, **checkpointer_kwargs: Any) -> None:
        """``checkpointer``: one you built; else one is built from ``checkpointer_kwargs`` (every
        :class:`Checkpointer` argument: ``every_steps``, ``local_dir``, ...) when training starts, after
        the Trainer has set up torch.distributed. ``resume_dir``: where the resume folder is written
        (default: the temporary directory, ``$TMPDIR``); it holds a copy of the model and optimizer."""
        self._given = given_checkpointer(checkpointer, checkpointer_kwargs)
        self._kwargs = dict(checkpointer_kwargs)
        self.record_loss = record_loss
        self.resume_dir = resume_dir
        self.ckpt: Checkpointer | None = checkpointer
        self.restored_step = 0
        self._trainer: Any = None
        self._prepared = False
        self._folder: str | None = None
        self._loss: torch.Tensor | None = None
        self._pending: tuple[int, dict[str, float] | None] | None = None  # the step that ended, not yet saved
        self._epoch_end = False  # the pending step ended its epoch, whose end has not been handled yet
        self._epochs_begun = 0  # in this process (an IterableDataset read again is a resume that is not exact)
        self._snapshot = _TrainerSnapshot(self)
        self._fetch = _FetchRng()

    def __getattr__(self, name: str) -> Any:
        """Every Trainer hook this class does not define does nothing (and returns no new control)."""
        if name.startswith("on_"):
            return _no_op
        raise AttributeError(name)

    @property
    def should_stop(self) -> bool:
        """True once an emergency checkpoint has committed (the Trainer was told to stop)."""
        return self.ckpt is not None and self.ckpt.should_stop

    # ------------------------------------------------------------------------------------- resume
    def train(self, trainer: Any, **train_kwargs: Any) -> Any:
        """Restore the newest committed step, train (``trainer.train``), close the Checkpointer.

        Returns what ``trainer.train`` returns. Leave the program with exit 0 after it: when
        :attr:`should_stop` is True, the launcher requeues the job and the next run resumes here."""
        if "resume_from_checkpoint" in train_kwargs:
            raise ConfigError("train(trainer) resumes from rslurm's checkpoints: leave out resume_from_checkpoint "
                              "(the Trainer's own checkpoints are not read)")
        self._check(trainer)
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if self.ckpt is None:
            self.ckpt = Checkpointer(**self._kwargs)
        self._trainer = trainer
        if self.record_loss and not getattr(trainer.training_step, "_rslurm_watch", False):
            self._watch_loss(trainer)
        try:
            folder = self._restore(trainer)
            self._prepared = True
            result = trainer.train(resume_from_checkpoint=folder, **train_kwargs)
        except BaseException:
            self._remove_folder()
            self._fetch.uninstall()
            if self._given is None:
                with contextlib.suppress(CheckpointError):
                    self.ckpt.close(failed=True)
            raise
        self._remove_folder()
        self._fetch.uninstall()
        if self._given is None:
            self.ckpt.close()
        return result

    @staticmethod
    def _check(trainer: Any) -> None:
        """Refuse what the resume cannot do, before anything is restored."""
        if getattr(trainer, "model_init", None) is not None:
            raise ConfigError("Trainer(model_init=...) builds a new model inside train(), after rslurm restored "
                              "it: pass the model itself (model=...) to resume with rslurm")
        for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP"),
                           ("is_fsdp_xla_enabled", "FSDP on XLA")):
            if getattr(trainer, flag, False):
                raise ConfigError(f"the Trainer integration supports DDP and single-process training, not {what}: "
                                  f"use the Checkpointer in a loop of your own (docs/integration.md)")
        if trainer.args.max_steps <= 0 and trainer.args.num_train_epochs <= 0:
            raise ConfigError("the Trainer has nothing to train (max_steps and num_train_epochs are 0)")
        if getattr(trainer.args, "train_sampling_strategy", None) == "group_by_length" or getattr(
                trainer.args, "group_by_length", False):
            raise ConfigError("TrainingArguments(train_sampling_strategy='group_by_length') draws each epoch's order "
                              "from the global RNG when the epoch's loader starts (a LengthGroupedSampler without a "
                              "generator), so a resume mid-epoch would train another order: use 'batch_rebalance' "
                              "(seeded) or the default 'random' to resume with rslurm")
        if getattr(trainer.args, "ignore_data_skip", False):
            raise ConfigError("TrainingArguments(ignore_data_skip=True) retrains the batches of the resumed epoch "
                              "from its start: leave it False to resume with rslurm")

    def _state(self, trainer: Any) -> dict[str, Any]:
        """What one step saves. The Trainer's state and the scheduler's are plain data, one JSON string read
        only when a save reads it (:class:`_TrainerSnapshot`): restored before the Trainer creates its
        scheduler, they reach it through the folder."""
        state: dict[str, Any] = {"model": trainer.model, "optimizer": inner(trainer.optimizer, "optimizer"),
                                 TRAINER_KEY: self._snapshot, FETCH_RNG_KEY: self._fetch}
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _restore(self, trainer: Any) -> str | None:
        """Restore the newest step into the model and the optimizer the Trainer will keep; write it out as
        the Trainer's checkpoint folder. None when there is nothing to restore (a fresh run)."""
        assert self.ckpt is not None
        if trainer.optimizer is None:
            trainer.create_optimizer()  # the Trainer keeps an optimizer it already has (create_optimizer)
        # The Trainer's scheduler (created later, in train()) adds ``initial_lr`` to every parameter group, so
        # the saved groups hold it: give the template one too (a scheduler keeps a value already there, and a
        # step saved without a scheduler that sets it keeps this one).
        for group in inner(trainer.optimizer, "optimizer").param_groups:
            group.setdefault("initial_lr", group["lr"])
        # A step saved before the fetch RNG was, or with other CUDA devices, resumes as the Trainer alone would.
        step = self.ckpt.restore(self._state(trainer), allow_missing=["optimizer.param_groups.*.initial_lr",
                                                                      f"{FETCH_RNG_KEY}.*"],
                                 allow_unexpected=[f"{FETCH_RNG_KEY}.*"])
        self.restored_step = step
        if step == 0:
            return None
        self._fetch.restored(step, rng.capture_rng_state())  # the step's own RNG, as the Checkpointer just set it
        saved = self._snapshot.loaded
        if not saved or saved.get("version") != STATE_VERSION or saved.get("trainer_state") is None:
            raise CheckpointError(f"step {step} was not saved by the Trainer integration (no Trainer state under "
                                  f"{TRAINER_KEY!r}); restore it with the Checkpointer itself")
        return self._write_folder(trainer, step, saved)

    def _write_folder(self, trainer: Any, step: int, saved: Mapping[str, Any]) -> str:
        tr = require("transformers.trainer")
        base = self.resume_dir
        if base is not None:
            os.makedirs(base, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=f"rslurm-hf-step{step}-rank{self.ckpt.rank if self.ckpt else 0}-", dir=base)
        self._folder = folder
        # Every tensor under its own name, tied ones included (copies: safetensors refuses shared storage),
        # so the Trainer's non-strict load finds every key. Not save_pretrained: it writes on rank 0 only.
        from safetensors.torch import save_file  # noqa: PLC0415 - transformers requires safetensors

        weights = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in trainer.model.state_dict().items()}
        save_file(weights, os.path.join(folder, tr.SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        del weights
        torch.save(inner(trainer.optimizer, "optimizer").state_dict(), os.path.join(folder, tr.OPTIMIZER_NAME))
        if saved.get("scheduler") is not None:
            torch.save(saved["scheduler"], os.path.join(folder, tr.SCHEDULER_NAME))
        with open(os.path.join(folder, tr.TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(saved["trainer_state"], f)
        trainer._save_rng_state(folder)  # the RNG the Checkpointer just restored, in the Trainer's own format
        return folder

    def _remove_folder(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _watch_loss(self, trainer: Any) -> None:
        """Sum each step's micro-batch losses as ``training_step`` returns them (nothing else changes)."""
        inner = trainer.training_step

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = inner(*args, **kwargs)
            if isinstance(loss, torch.Tensor):
                value = loss.detach().double()
                self._loss = value if self._loss is None else self._loss + value
            return loss

        training_step._rslurm_watch = True  # type: ignore[attr-defined]
        trainer.training_step = training_step

    # ---------------------------------------------------------------------------------------- hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._prepared:
            raise ConfigError("RslurmCallback resumes through train(trainer): call "
                              "resilient_slurm.integrations.hf.train(trainer, ...) (or callback.train(trainer)) "
                              "instead of trainer.train()")
        self._snapshot.training = True
        loader = kwargs.get("train_dataloader")
        if loader is not None:
            protect_dataloader(loader)
            self._fetch.install(loader)
        if state.global_step != self.restored_step:
            raise CheckpointError(f"the Trainer resumed at step {state.global_step}, rslurm restored step "
                                  f"{self.restored_step}")
        running = (self._snapshot.loaded or {}).get("running") if self.restored_step else None
        if running is not None:  # the loss summed since the last log: the next logged loss averages the same steps
            dtype = getattr(torch, str(running.get("dtype")), None) if isinstance(running, dict) else None
            flos = running.get("current_flos", 0.0) if isinstance(running, dict) else None  # absent: saved before
            if (not isinstance(dtype, torch.dtype) or not isinstance(running.get("tr_loss"), (int, float))
                    or not isinstance(running.get("last_logged"), int) or not isinstance(flos, (int, float))):
                raise CheckpointError(f"step {self.restored_step}: the Trainer's running loss under {TRAINER_KEY!r} "
                                      f"is malformed ({str(running)[:200]}); restore another step (rslurm verify)")
            trainer = self._trainer
            trainer._tr_loss = torch.tensor(running["tr_loss"], dtype=dtype, device=trainer._tr_loss.device)
            trainer._globalstep_last_logged = running["last_logged"]
            trainer.current_flos = float(flos)  # counted since the last log: the next store_flos adds them
            # The Trainer's final train_loss is the mean over the steps this train() call trained: the restored
            # loss of steps before the resume is taken back out of its total.
            trainer._total_loss_scalar = -float(running["tr_loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_folder()  # the resumed Trainer has read all of it by the end of its first step
        metrics = None
        if self.record_loss and self._loss is not None:
            metrics = {"loss": float(self._loss.item())}
            self._loss = None
        self._pending = (state.global_step, metrics)
        self._fetch.keep()  # before an evaluation, which may read the same dataset
        self._epoch_end = float(state.epoch or 0.0).is_integer()
        self._save_if_nothing_follows(control)

    # The step is saved once the Trainer has done what it does after it, before the next batch: a log (its
    # entry belongs in the saved log history), an evaluation (it draws from the RNG, its DataLoader's seed, and
    # the resumed Trainer does not evaluate that step again), the epoch's end (which may log and evaluate).
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_nothing_follows(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_nothing_follows(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_end = False
        self._save_if_nothing_follows(control)

    def _save_if_nothing_follows(self, control: Any) -> None:
        if not (control.should_log or control.should_evaluate or self._epoch_end):
            self._save(control)

    # A step left pending (a log or an evaluation that did not come): saved before the next one.
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save(control)
        self._epochs_begun += 1
        if self._epochs_begun == 1:
            self._fetch.arm(self._trainer)
        dataset = getattr(self._trainer, "train_dataset", None)
        if self._epochs_begun == 2 and dataset is not None and not hasattr(dataset, "__len__"):
            log.warning("the Trainer reads its IterableDataset a second time: a resume from a step of this pass or a "
                        "later one will not be exact (the Trainer's resume skips global_step batches of one pass, so "
                        "it retrains from the start of a pass). Make the dataset yield for all of max_steps in one "
                        "pass (loop over the data inside __iter__) to resume exactly")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._fetch.stale()  # this step's batches are read: a step saved now has no pre-read state
        self._save(control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save(control)
        self._remove_folder()
        self._fetch.uninstall()

    def _save(self, control: Any) -> None:
        """``Checkpointer.step`` for the step that ended last, once; after an emergency save, stop training."""
        if self._pending is None:
            return
        trainer, ckpt = self._trainer, self.ckpt
        assert trainer is not None and ckpt is not None
        step, metrics = self._pending
        self._pending = None
        if ckpt.should_stop:
            return
        ckpt.step(step, self._state(trainer), metrics=metrics)
        if ckpt.should_stop:
            control.should_training_stop = True


class _TrainerSnapshot:
    """The ``TrainerState`` and the LR scheduler's ``state_dict()`` as one JSON string, built only when the
    Checkpointer reads it (a save, and its first step's planning): the log history grows with the run, and
    serialising it at every step would cost more than the step on small models."""

    def __init__(self, callback: RslurmCallback) -> None:
        self._callback = callback
        self.training = False  # until on_train_begin, the Trainer has no scheduler and no state of its run
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer = self._callback._trainer
        scheduler = trainer_state = None
        if self.training and trainer is not None:
            sched = trainer.lr_scheduler
            scheduler = inner(sched, "scheduler").state_dict() if sched is not None else None
            trainer_state = _trainer_state(trainer, trainer.state)
        running = None
        tr_loss = getattr(trainer, "_tr_loss", None) if self.training else None
        if isinstance(tr_loss, torch.Tensor):  # the Trainer's loss since its last log (its _maybe_log_save_evaluate)
            running = {"tr_loss": float(tr_loss.item()), "dtype": str(tr_loss.dtype).split(".")[-1],
                       "last_logged": int(trainer._globalstep_last_logged),
                       "current_flos": float(getattr(trainer, "current_flos", 0.0))}
        return {"json": json.dumps({"version": STATE_VERSION, "scheduler": scheduler, "trainer_state": trainer_state,
                                    "running": running})}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = json.loads(sd["json"])


class _FetchRng:
    """Exact resumes when reading a batch draws from the global RNGs in the main process (a dataset's
    augmentation, a collator's masking, with ``dataloader_num_workers=0``).

    Accelerate's loader reads one batch ahead: when step k ends, the first batch of step k+1 has been read,
    so its draws are in the RNG state step k saves. A resumed Trainer reads that batch and the next one from
    whatever state the process is in, and only then restores the saved state. So the state from just before
    each batch is read is taken (:func:`rng.raw_rng_state`, tens of microseconds), the one from before the
    look-ahead read is saved with the step (``fetch_rng``), and at a resume mid-epoch the first batch read
    starts from it, the second from the step's own state, and the Trainer's own RNG restore, which would go
    back, is skipped. At an epoch boundary the Trainer restores before reading, and its path is kept.

    The hook is the dataset's ``__getitems__`` (an attribute of the instance, removed when training ends):
    torch's fetcher calls it before reading the samples and collating them. It is installed only where the
    fetch runs in the main process of an Accelerate ``DataLoaderShard`` over a map-style dataset."""

    def __init__(self) -> None:
        self.dataset: Any = None
        self.last: tuple[Any, ...] | None = None  # the raw RNG state before the last read
        self.kept: tuple[Any, ...] | None = None  # ``last`` when the last step ended
        self.loaded: Mapping[str, Any] | None = None
        self.resume: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None  # (before the read, the step's own)
        self.resumed_reads = 0
        self._trainer: Any = None

    # ---------------------------------------------------------------------------------- saving
    def install(self, loader: Any) -> None:
        data_loader = require("accelerate.data_loader")
        base = getattr(loader, "base_dataloader", loader)
        dataset = getattr(base, "dataset", None)
        if getattr(base, "num_workers", 1) != 0 or dataset is None:
            return  # read in worker processes: nothing drawn in this one
        if (not isinstance(loader, data_loader.DataLoaderShard) or isinstance(dataset, torch.utils.data.IterableDataset)
                or not hasattr(dataset, "__dict__") or "__getitems__" in vars(dataset)):
            log.info("the Trainer's train loader (%s over %s) is read in this process in a way rslurm does not "
                     "follow: random draws made while a batch is read will not resume exactly (docs/integration.md)",
                     type(loader).__name__, type(dataset).__name__)
            return
        own = getattr(dataset, "__getitems__", None)

        def getitems(indices: Any) -> Any:
            self._before_read()
            return own(indices) if own else [dataset[i] for i in indices]

        try:
            dataset.__getitems__ = getitems
        except (AttributeError, TypeError):  # a class that refuses new attributes: its reads are not followed
            log.info("cannot follow the reads of %s (it refuses new attributes): random draws made while a batch "
                     "is read will not resume exactly (docs/integration.md)", type(dataset).__name__)
            return
        self.dataset = dataset

    def uninstall(self) -> None:
        if self.dataset is not None:
            vars(self.dataset).pop("__getitems__", None)
            self.dataset = None
        self._disarm()

    def _before_read(self) -> None:
        if self.resume is not None and self._trainer is not None:
            before, own = self.resume
            rng.restore_rng_state(before if self.resumed_reads == 0 else own)
            self.resumed_reads += 1
            if self.resumed_reads == 2:
                self.resume = None
        self.last = rng.raw_rng_state()

    def keep(self) -> None:
        """A step ended: its save (now, or after its log or evaluation, whose reads of an eval dataset that is
        the train dataset go through the hook too) saves the state from before the last read of the train
        loader, the look-ahead one."""
        self.kept = self.last

    def stale(self) -> None:
        """The next step's batches are read: a step still pending (saved now, late) has no state from
        before its look-ahead read; it resumes as the Trainer alone resumes."""
        self.kept = None

    def state_dict(self) -> dict[str, Any]:
        kept = self.kept
        return {"recorded": int(kept is not None),
                "rng": rng.pack_rng_state(kept) if kept is not None else rng.capture_rng_state()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.loaded = sd

    # ---------------------------------------------------------------------------------- resuming
    def restored(self, step: int, own: Mapping[str, Any]) -> None:
        """Step ``step`` was restored; ``own`` is its RNG state (the one the Trainer's folder holds). A saved
        state that cannot be applied is refused now, before training goes on, not at the first read."""
        loaded, self.loaded = self.loaded, None
        if loaded is None or loaded.get("recorded") != 1:
            return
        try:
            rng.plan_rng_state(loaded.get("rng"))  # type: ignore[arg-type]  # not a mapping: the error says so
        except IncompatibleCheckpointError as exc:
            raise IncompatibleCheckpointError(
                f"step {step}: {FETCH_RNG_KEY}.rng, the RNG state from before the look-ahead read, is malformed "
                f"({exc}); this step cannot resume exactly: restore an earlier one (rslurm ls lists them)") from exc
        self.resume = (loaded["rng"], own)

    def arm(self, trainer: Any) -> None:
        """The resumed run's first epoch begins: follow its first reads, and take over the Trainer's RNG
        restore (an attribute of the instance until the Trainer calls it once)."""
        if self.resume is None or self.dataset is None:
            self.resume = None
            return
        self._trainer = trainer
        self.resumed_reads = 0
        real = trainer._load_rng_state

        def load_rng_state(checkpoint: Any) -> None:
            resume, reads = self.resume, self.resumed_reads
            self._disarm()
            if reads == 0:  # at an epoch boundary the Trainer restores before reading: its own path
                real(checkpoint)
            elif resume is not None:  # the epoch had one batch left: no second read took the step's own state
                rng.restore_rng_state(resume[1])
            # else the reads started from the saved states: the RNG is where the run never stopped has it

        trainer._load_rng_state = load_rng_state

    def _disarm(self) -> None:
        self.resume = None
        if self._trainer is not None:
            vars(self._trainer).pop("_load_rng_state", None)
            self._trainer = None


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _trainer_state(trainer: Any, state: Any) -> dict[str, Any]:
    """The TrainerState as the Trainer's own checkpoints write it: its stateful callbacks' states
    (early stopping's patience...) refreshed first, as ``Trainer._save_checkpoint`` does."""
    tcb = require("transformers.trainer_callback")
    callbacks: dict[str, Any] = {}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, tcb.ExportableState):
            name = type(cb).__name__
            if isinstance(cb, tcb.TrainerControl):
                callbacks[name] = tcb.TrainerControl().state()  # a resume starts with no pending action
            elif name in callbacks:
                prev = callbacks[name]
                callbacks[name] = [*(prev if isinstance(prev, list) else [prev]), cb.state()]
            else:
                callbacks[name] = cb.state()
    out = dataclasses.asdict(state)
    out["stateful_callbacks"] = callbacks
    return out


def train(trainer: Any, checkpointer: Checkpointer | None = None, *, record_loss: bool = True,
          resume_dir: str | None = None, **checkpointer_kwargs: Any) -> Any:
    """``trainer.train()`` with rslurm's checkpoints: restore the newest committed step, train, save at every
    step boundary on cadence or on request, stop after an emergency save. Returns ``trainer.train``'s
    result; ``trainer.should_stop``-style information is on the callback (``trainer.callback_handler``).

    Uses the :class:`RslurmCallback` already added to the Trainer, else adds one built from the arguments."""
    if "resume_from_checkpoint" in checkpointer_kwargs:
        raise ConfigError("train(trainer) resumes from rslurm's checkpoints: leave out resume_from_checkpoint "
                          "(the Trainer's own checkpoints are not read)")
    mine = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, RslurmCallback)]
    if len(mine) > 1:
        raise ConfigError("the Trainer has several RslurmCallback: keep one")
    if mine:
        if checkpointer is not None or checkpointer_kwargs:
            raise ConfigError("the Trainer already has an RslurmCallback: give the Checkpointer's arguments to it, "
                              "not to train()")
        return mine[0].train(trainer)
    return RslurmCallback(checkpointer, record_loss=record_loss, resume_dir=resume_dir,
                          **checkpointer_kwargs).train(trainer)
