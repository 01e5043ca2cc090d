"""PyTorch Lightning: rslurm's checkpoints, emergency save and requeue for a ``Trainer``, in one line::

    trainer = L.Trainer(..., callbacks=[ResilientSlurm(every_steps=100)])

A Callback, because a Callback is what a Lightning user already passes, it sees every step boundary
(``on_train_batch_end``, where Lightning's own ModelCheckpoint saves too) and it runs inside ``fit()``,
after the process group exists. What it does there (docs/integration.md, "PyTorch Lightning"):

* ``setup``: builds the :class:`~resilient_slurm.Checkpointer` (every rank), refuses strategies it does not
  support, turns off Lightning's SIGTERM handler and SLURMEnvironment's requeue under ``rslurm launch``
  (the Checkpointer's handler and the launcher take their place), and has the train DataLoader built on a
  :class:`~resilient_slurm.ResumableSampler` in place of Lightning's DistributedSampler;
* ``on_fit_start`` (after the strategy wrapped the model and built the optimizers): restores the newest
  step through the Checkpointer, then hands the fit loop's progress, the optimizers' and schedulers'
  states to Lightning's own ``restore_training_state``, which runs right after this hook, exactly as for a
  ``ckpt_path`` (Lightning then resumes mid-epoch as it does from its own checkpoints), and gives the
  other callbacks (EarlyStopping, ModelCheckpoint) their saved states;
* ``on_train_batch_end``: moves the sampler's position to the batches the loop has finished (Lightning
  fetches one batch ahead, so counting what the loader handed out would be one batch off) and calls
  ``ckpt.step(global_step, state, metrics={"loss": ...})``; once an emergency save committed it sets
  ``trainer.should_stop``.

The data position travels inside the fit loop's state: the train DataLoader gets ``state_dict`` and
``load_state_dict`` (Lightning's "stateful dataloader" protocol), so Lightning stores the sampler's
position with its loop progress and gives it back when it builds the loader on resume.

Lightning internals used, each pinned by tests/test_lightning.py so an upgrade that changes them fails
there: ``trainer._checkpoint_connector._loaded_checkpoint`` (the restore hand-over),
``trainer._data_connector._prepare_dataloader`` (where Lightning puts its DistributedSampler),
``trainer._signal_connector.register_signal_handlers``, ``lightning.pytorch.utilities.data._update_dataloader``,
``lightning.fabric.utilities.data._auto_add_worker_init_fn``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from .. import config as settings
from ..checkpoint.checkpointer import Checkpointer
from ..checkpoint.sampler import ResumableSampler
from ..checkpoint.workers import protect_dataloader
from ..errors import ConfigError, IncompatibleCheckpointError
from ..jobenv import JobEnv

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader
    from lightning.pytorch.utilities.exceptions import _TunerExitException
    from lightning.pytorch.utilities.rank_zero import rank_zero_info
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "resilient_slurm.integrations.lightning needs PyTorch Lightning (the 'lightning' package): "
        "pip install 'resilient_slurm[lightning]'"
    ) from exc

log = logging.getLogger(__name__)


def _say(msg: str, *args: Any) -> None:
    """An INFO line where a Lightning user reads Lightning's own: rank 0, through Lightning's logger."""
    rank_zero_info(msg % args)

__all__ = ["ResilientSlurm"]

LOOPS_KEY = "lightning_loops"
CALLBACKS_KEY = "lightning_callbacks"
DATAMODULE_KEY = "lightning_datamodule"  # only for a DataModule with a state of its own
# Runs whose fit() ran to its end in this process (Checkpointer.run_dir): a second fit() on one of them would
# resume the first one's last step (a pretraining and a fine-tuning stage sharing a run id).
_FINISHED: set[str] = set()


class _LoopState:
    """The fit loop's progress (epochs, batches, optimizer steps, the train DataLoader's position) as a
    stateful value of the Checkpointer's state. Its state is one JSON string: the loop's keys hold dots
    (``epoch_loop.batch_progress``), which the checkpoint's names reserve for nesting."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        import json

        return {"fit_loop": json.dumps(self.trainer.fit_loop.state_dict(), sort_keys=True)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import json

        self.loaded = json.loads(state["fit_loop"])


def _loadable_blob(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, checked to load back with ``weights_only`` (as the resume reads them):
    a value a checkpoint cannot load safely (an object of a class of the program's own, a NumPy array) is a
    ConfigError at the save, not a failed resume hours later."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{what} holds a value a resume could not load safely (torch.load with weights_only): "
                          f"{str(exc).splitlines()[0][:300]}; keep to tensors, numbers, strings, lists and dicts"
                          ) from exc
    return data


class _CallbackStates:
    """The other callbacks' states (``EarlyStopping``'s patience and best score, ``ModelCheckpoint``'s best
    and top-k files), as Lightning saves them in its own checkpoints (``Callback.state_dict`` by
    ``state_key``). One blob (``torch.save``): the keys hold Lightning's state keys, braces and dots
    included, and the values tensors and paths; read back with ``weights_only``."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:

        from lightning.pytorch.trainer import call

        return {"callbacks": _loadable_blob(call._call_callbacks_state_dict(self.trainer), "the callbacks' states")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import io

        self.loaded = torch.load(io.BytesIO(state["callbacks"]), map_location="cpu", weights_only=True)

    def apply(self) -> None:
        """Into the Trainer's callbacks (Lightning's own restore of them ran before ``on_fit_start``)."""
        from lightning.pytorch.trainer import call

        if self.loaded:
            call._call_callbacks_load_state_dict(self.trainer, {"callbacks": self.loaded})


class _DataModuleState:
    """A ``LightningDataModule``'s own state (its ``state_dict``), as Lightning saves it in its checkpoints
    (under the class's name there): one ``torch.save`` blob, read back with ``weights_only``. Lightning
    restored the datamodule before ``on_fit_start`` from its own checkpoint (none under rslurm): rslurm's is
    applied in ``on_fit_start``, before the loops resume."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:

        from lightning.pytorch.trainer import call

        state = call._call_lightning_datamodule_hook(self.trainer, "state_dict") or {}
        name = type(getattr(self.trainer, "datamodule", None)).__name__
        return {"datamodule": _loadable_blob(state, f"{name}.state_dict()")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import io

        self.loaded = torch.load(io.BytesIO(state["datamodule"]), map_location="cpu", weights_only=True)

    def apply(self) -> None:
        from lightning.pytorch.trainer import call

        if self.loaded is not None:
            call._call_lightning_datamodule_hook(self.trainer, "load_state_dict", self.loaded)


def _stateful_datamodule(trainer: pl.Trainer) -> bool:
    """The Trainer has a LightningDataModule that keeps a state of its own (overrides ``state_dict``)."""
    dm = getattr(trainer, "datamodule", None)  # a property Lightning sets up in fit()
    return dm is not None and type(dm).state_dict is not pl.LightningDataModule.state_dict


class _SamplerPosition:
    """What Lightning stores for the train DataLoader (``state_dict``/``load_state_dict`` on the loader)."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


class ResilientSlurm(pl.Callback):
    """rslurm's checkpointing for a Lightning ``Trainer``: ``Trainer(..., callbacks=[ResilientSlurm()])``.

    Keyword arguments go to :class:`~resilient_slurm.Checkpointer` (``every_steps``, ``every_seconds``,
    ``local_dir``, ``durable``, ``keep_last``...). ``record_loss``: pass the training step's loss to
    ``ckpt.step(metrics=...)`` (what ``rslurm rehearse`` and the post-resume check compare); ``.item()``
    on a CUDA loss waits for the GPU each step.

    After ``trainer.fit()`` returns, :attr:`should_stop` is True when it stopped for an emergency save:
    skip what comes after training (testing, exporting) and exit 0, and the launcher requeues the job.
    """

    def __init__(self, *, record_loss: bool = True, **checkpointer_kwargs: Any) -> None:
        import inspect

        known = set(inspect.signature(Checkpointer).parameters)
        unknown = sorted(set(checkpointer_kwargs) - known)
        if unknown:  # here, not inside fit() on every rank
            raise ConfigError(f"ResilientSlurm got {', '.join(map(repr, unknown))}: not a Checkpointer argument "
                              f"(those are {', '.join(sorted(known))})")
        # A bad value (every_steps=-1) fails here too, not first inside fit() on every rank; the environment and
        # the config file are checked with it, as the Checkpointer will.
        settings.load({k: v for k, v in checkpointer_kwargs.items() if k in settings.SETTINGS},
                      config_path=checkpointer_kwargs.get("config_path"))
        self.record_loss = record_loss
        self.checkpointer_kwargs = checkpointer_kwargs
        self.ckpt: Checkpointer | None = None
        self.state: dict[str, Any] = {}
        self.restored_step = 0
        self._sampler: ResumableSampler | None = None
        self._batch_size = 1
        self._last_step = -1
        self._sections = contextlib.ExitStack()
        self._stopped = False
        self._exit_pending = False  # an emergency save committed: end fit() at the next hook (_exit_if_stopped)

    @property
    def should_stop(self) -> bool:
        """True once an emergency checkpoint committed and the fit loop was told to stop (also after fit())."""
        return self._stopped or (self.ckpt is not None and self.ckpt.should_stop)

    # ----------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _check_strategy(trainer)
        if trainer.fit_loop.min_epochs or trainer.fit_loop.min_steps:
            log.warning("rslurm: Trainer(min_epochs=%s, min_steps=%s): until they are reached Lightning does not "
                        "stop fit() after an emergency save, and the launcher ends the ranks when its deadline "
                        "passes; leave them unset for preemptible jobs", trainer.fit_loop.min_epochs,
                        trainer.fit_loop.min_steps)
        _quiet_lightning_signals(trainer)
        self._replace_sampler(trainer)
        if self.ckpt is None:  # one per fit(): teardown closes it
            ckpt = Checkpointer(**self.checkpointer_kwargs)
            if ckpt.run_dir in _FINISHED:
                run = os.path.basename(ckpt.run_dir)
                ckpt.close()
                raise ConfigError(
                    f"run {run!r} ({ckpt.run_dir}) already ran a fit() to its end in this program: another fit() "
                    f"on it would resume that one's last step and train nothing new (a pretraining and a "
                    f"fine-tuning stage, two Trainers). Give each stage its own run: "
                    f"ResilientSlurm(run_id='{run}-finetune', ...)")
            self.ckpt = ckpt
            self._stopped, self._sampler, self._last_step, self._exit_pending = False, None, -1, False

    def _replace_sampler(self, trainer: pl.Trainer) -> None:
        connector = trainer._data_connector
        original: Callable[..., object] = connector._prepare_dataloader
        if getattr(original, "_rslurm", False):
            return  # a second fit() on this Trainer: already in place

        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            if mode != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
                return original(dataloader, shuffle, mode)
            return self._resumable_loader(trainer, dataloader, shuffle, original, mode)

        prepare._rslurm = True  # type: ignore[attr-defined]
        connector._prepare_dataloader = prepare  # type: ignore[method-assign]

    def _resumable_loader(self, trainer: pl.Trainer, loader: DataLoader[Any], shuffle: bool,
                          original: Callable[..., object], mode: RunningStage) -> object:
        """The train loader on a ResumableSampler (length="epoch"), with Lightning's stateful-loader methods."""
        batch_sampler = loader.batch_sampler
        sampler = loader.sampler
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            log.warning("rslurm: the train DataLoader reads an IterableDataset (%s): no position in it can be "
                        "saved, so a resumed run does not read the data a run never stopped would, and is not "
                        "bitwise identical to it. Use a map-style dataset (__getitem__, __len__) for an exact "
                        "resume", type(loader.dataset).__name__)
            return original(loader, shuffle, mode)
        if not isinstance(batch_sampler, BatchSampler) or type(batch_sampler) is not BatchSampler:
            log.warning("rslurm: the train DataLoader has its own batch_sampler (%s): its position in the epoch "
                        "is not saved, so a resumed run does not read the data a run never stopped would, and "
                        "is not bitwise identical to it. Use a map-style dataset with batch_size=, or a "
                        "ResumableSampler", type(batch_sampler).__name__)
            return original(loader, shuffle, mode)
        if isinstance(sampler, ResumableSampler):
            sampler.length = "epoch"
            prepared = loader
        elif type(sampler) in (SequentialSampler, RandomSampler, DistributedSampler):
            distributed = type(sampler) is DistributedSampler or trainer._accelerator_connector.use_distributed_sampler
            if isinstance(sampler, DistributedSampler):
                seed, drop_last, shuffle = sampler.seed, sampler.drop_last, sampler.shuffle
            else:
                # Lightning's own DistributedSampler would take this seed (data_connector.py).
                seed, drop_last = int(os.environ.get("PL_GLOBAL_SEED", 0)), False
            replicas, rank = (trainer.world_size, trainer.global_rank) if distributed else (1, 0)
            sampler = ResumableSampler(loader.dataset, num_replicas=replicas, rank=rank,  # type: ignore[arg-type]
                                       shuffle=shuffle, seed=seed, drop_last=drop_last, length="epoch")
            prepared = _update_dataloader(loader, sampler, mode=mode)
            _say("rslurm: the train DataLoader samples through ResumableSampler (rank %d of %d, shuffle=%s, "
                     "seed=%d): its position is saved with every checkpoint", rank, replicas, shuffle, seed)
        else:
            log.warning("rslurm: the train DataLoader's sampler (%s) is not a ResumableSampler: its position in "
                        "the epoch is not saved, so a resumed run does not read the data a run never stopped "
                        "would, and is not bitwise identical to it", type(sampler).__name__)
            return original(loader, shuffle, mode)
        if prepared.generator is None:
            # Creating a DataLoader iterator draws its workers' base seed from the global torch RNG: a resumed
            # run creates it mid-epoch, which would shift every later dropout mask. A generator of its own
            # keeps the global stream a function of the training steps alone.
            prepared.generator = torch.Generator().manual_seed(sampler.seed)
        previous = self._sampler
        if previous is not None and previous is not sampler:
            # A reload (reload_dataloaders_every_n_epochs): the position belongs to the run, not to the loader.
            # Lightning creates the new loader's iterator before it sets the epoch (and, on a resume at an
            # epoch's end, keeps that iterator), so a fresh sampler would hand out epoch 0's order there.
            try:
                sampler.load_state_dict(previous.state_dict())
            except IncompatibleCheckpointError as exc:  # another dataset, seed or shuffle: its epoch only
                log.info("rslurm: the reloaded train DataLoader starts its epoch afresh (%s)", exc)
                sampler.set_epoch(previous.epoch)
        # Slurm signals every process of the step: workers must outlive it. Lightning's own worker seeding
        # (seed_everything(workers=True)) is added first, as Lightning would add it after this hook, so the
        # shield runs it too.
        _auto_add_worker_init_fn(prepared, trainer.global_rank)
        protect_dataloader(prepared)
        position = _SamplerPosition(sampler)
        prepared.state_dict = position.state_dict  # type: ignore[attr-defined]
        prepared.load_state_dict = position.load_state_dict  # type: ignore[attr-defined]
        self._sampler = sampler
        self._batch_size = prepared.batch_size or 1
        return prepared

    # ----------------------------------------------------------------------------------- restore
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ckpt is not None, "setup() builds the Checkpointer"
        loops = _LoopState(trainer)
        state: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state["optimizer" if i == 0 else f"optimizer_{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            state["lr_scheduler" if i == 0 else f"lr_scheduler_{i}"] = cfg.scheduler
        precision = trainer.precision_plugin
        if precision.state_dict():
            state["precision"] = precision
        state[LOOPS_KEY] = loops
        callbacks = _CallbackStates(trainer)
        state[CALLBACKS_KEY] = callbacks
        datamodule = _DataModuleState(trainer) if _stateful_datamodule(trainer) else None
        if datamodule is not None:
            state[DATAMODULE_KEY] = datamodule
        self.state = state
        # A step saved while the DataModule had no state of its own (or by an earlier rslurm) lacks its key:
        # the DataModule then keeps its state (the restore warns: "kept the state's current values for ...").
        step = self.ckpt.restore(state, allow_missing=[f"{DATAMODULE_KEY}.*"] if datamodule is not None else None)
        self.restored_step = self._last_step = step
        if not step:
            return
        if loops.loaded is None:
            raise ConfigError(f"step {step} was not saved by ResilientSlurm (no {LOOPS_KEY!r} in it)")
        if trainer.ckpt_path:
            log.warning("rslurm: resuming from rslurm's step %d, not from ckpt_path=%s", step, trainer.ckpt_path)
        # Lightning's restore_training_state runs right after this hook: it restores the loops (mid-epoch
        # resume included) and reloads the optimizers and schedulers from what was just restored here.
        handed: dict[str, Any] = {
            "loops": {"fit_loop": loops.loaded},
            "optimizer_states": [opt.state_dict() for opt in trainer.optimizers],
            "lr_schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        }
        if "precision" in state:
            handed[type(precision).__qualname__] = precision.state_dict()
        trainer._checkpoint_connector._loaded_checkpoint = handed
        callbacks.apply()
        if datamodule is not None:
            datamodule.apply()
        _say("rslurm: resumed at step %d (epoch %d)", step,
                 loops.loaded.get("epoch_progress", {}).get("current", {}).get("processed", -1))

    # ----------------------------------------------------------------------------------- steps
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.ckpt is not None
        sampler = self._sampler
        if sampler is not None:
            # The batches the loop has finished this epoch, not what the loader prefetched.
            target = min((batch_idx + 1) * self._batch_size, sampler.epoch_length())
            done = sampler.consumed // sampler.num_replicas
            if target > done:
                sampler.advance(target - done)
        step = trainer.global_step
        if step <= self._last_step:
            return  # no optimizer step since the last call (gradient accumulation)
        self._last_step = step
        metrics = None
        if self.record_loss:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                metrics = {"loss": loss.detach()}
        self.ckpt.step(step, self.state, metrics=metrics)
        if self.ckpt.should_stop:
            _say("rslurm: emergency checkpoint of step %d committed: stopping the fit loop", step)
            trainer.should_stop = True
            self._exit_pending = True

    def _exit_if_stopped(self) -> None:
        """After an emergency save, the first of the hooks below that Lightning reaches ends fit(), as Lightning's
        tuner ends it (teardown, status finished, no exception out of fit()). `should_stop` alone would first
        run a validation, the epoch's end and the train end: a ModelCheckpoint (which Lightning runs after the
        other callbacks) would write files its saved state does not know of (stale top-k files after the
        resume), and a validation would spend the preemption's grace time after the save. Every callback has
        seen the last step's `on_train_batch_end`."""
        if self._exit_pending:
            self._exit_pending = False
            raise _TunerExitException()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_stopped()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_stopped()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n = _count_loaders(trainer.train_dataloader)
        if n > 1:
            raise ConfigError(
                f"ResilientSlurm keeps the position of one train DataLoader; train_dataloader() returned {n} "
                "(a CombinedLoader, a dict or a list of loaders), whose positions would be lost at a resume and "
                "the resumed run would differ: put the datasets in one loader (torch.utils.data.ConcatDataset, "
                "or a Dataset that returns a sample of each), or train them in separate fit() calls")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit_if_stopped()
        if self.ckpt is not None and trainer.state.fn == "fit":
            # No step() while validating: tell the launcher's hang detection (Checkpointer.section).
            self._sections.enter_context(self.ckpt.section("validation"))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sections.close()

    # ----------------------------------------------------------------------------------- end
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close(finished=not trainer.interrupted)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            self._close(failed=True)
        except Exception as inner:  # do not mask the exception that ended fit()
            log.error("rslurm: while closing the Checkpointer after %s: %s", type(exception).__name__, inner)

    def _close(self, *, finished: bool = False, failed: bool = False) -> None:
        self._sections.close()
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            self._stopped = ckpt.should_stop
            ckpt.close(failed=failed)
            if finished and not self._stopped:
                _FINISHED.add(ckpt.run_dir)


def _count_loaders(loaders: Any) -> int:
    """How many DataLoaders ``trainer.train_dataloader`` holds (a loader, or a collection of them)."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    if isinstance(loaders, CombinedLoader):
        loaders = loaders.flattened
    if isinstance(loaders, Mapping):
        return sum(_count_loaders(v) for v in loaders.values())
    if isinstance(loaders, (list, tuple)):
        return sum(_count_loaders(v) for v in loaders)
    return 1 if loaders is not None else 0


def _check_strategy(trainer: pl.Trainer) -> None:
    """Refuse what the integration does not support, naming what to use instead."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) or "DeepSpeed" in name:
        raise ConfigError(
            f"ResilientSlurm supports Lightning's DDP and single-device strategies, not {name}: use "
            "strategy='ddp' (or one device), or save with resilient_slurm.Checkpointer in your own loop "
            "(FSDP2 and DTensor: docs/integration.md)")
    env = trainer._accelerator_connector.cluster_environment
    job = JobEnv.from_env(warn=False)
    # Started by rslurm launch, srun or torchrun. In setup() the processes already exist, so Lightning's own
    # creates_processes_externally is True even in the processes Lightning started itself (it set LOCAL_RANK).
    outside = (bool(os.environ.get("RSLURM_CONTROL_SOCKET")) or job.step_id is not None
               or "TORCHELASTIC_RUN_ID" in job.raw)
    spawned = getattr(strategy, "_start_method", "popen") != "popen"  # ddp_spawn, ddp_fork, ddp_notebook
    if trainer.world_size > 1 and (spawned or not outside or not env.creates_processes_externally):
        raise ConfigError(
            f"Lightning is starting its own {trainer.world_size} processes ({name}, {type(env).__name__}): "
            "start every rank with `rslurm launch -n N -- python train.py` (or `rslurm launch -- srun ...`), "
            "so that the launcher can signal, save and requeue them; strategy='ddp' then joins those ranks")


def _quiet_lightning_signals(trainer: pl.Trainer) -> None:
    """Under ``rslurm launch``: Lightning's SIGTERM handler and SLURMEnvironment's requeue are turned off.

    Lightning's handler broadcasts inside the signal handler and ends fit() at the next step without a
    save, and SLURMEnvironment(auto_requeue=True) saves its own checkpoint and requeues on SIGUSR1; the
    Checkpointer's handler (a flag) and the launcher (save at a step boundary, then requeue) do both."""
    if not os.environ.get("RSLURM_CONTROL_SOCKET"):
        _say("rslurm: not under `rslurm launch`: Lightning's own signal handlers stay as they are")
        return
    env = trainer._accelerator_connector.cluster_environment
    if isinstance(env, SLURMEnvironment) and env.auto_requeue:
        env.auto_requeue = False
    connector = trainer._signal_connector

    def register_signal_handlers() -> None:
        connector.received_sigterm = False

    connector.register_signal_handlers = register_signal_handlers  # type: ignore[method-assign]
    _say("rslurm: Lightning's SIGTERM handler and SLURM auto-requeue are off under `rslurm launch`: "
             "rslurm saves at the next step boundary and the launcher requeues the job")
