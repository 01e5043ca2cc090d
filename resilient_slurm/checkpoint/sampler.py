"""A distributed-aware sampler whose position survives a restart mid-epoch, even on another world size.

Order. Each epoch has one global order, independent of the world size: a permutation ``P`` of the N
dataset indices drawn from ``torch.Generator().manual_seed(seed + epoch)`` (``range(N)`` without
shuffling), exactly as ``torch.utils.data.DistributedSampler`` draws it.

Position. The sampler counts ``consumed``: how many entries of the epoch's global order the training
loop has received, summed over all ranks (per-rank samples consumed x ``num_replicas``). Because ranks
take strides of the same order in lock step, the consumed samples are always the prefix ``P[:consumed]``.

Remainder. From a position, the rest of the epoch is ``P[consumed:]``, padded by repeating ``P`` from
its start until its length divides ``num_replicas`` (or, with ``drop_last``, truncated to the largest
multiple); rank ``r`` takes ``rest[r::num_replicas]``. At ``consumed == 0`` this is DistributedSampler's
order sample for sample. Restored on a different world size, every new rank skips the same first
``consumed`` global indices and takes its stride of the remainder, so together the new ranks see
exactly the samples not yet consumed; only the padding (fewer than ``num_replicas`` repeats of the
epoch's first samples) depends on the world size.

Advancing. DataLoader workers pull indices far ahead of the loop, so ``__iter__`` never moves the
position. :meth:`ResumableSampler.track` does: it yields the loader's batches and counts each batch as
consumed when the loop receives it. When ``track`` runs an epoch to its end, the sampler moves to the
start of the next epoch (``epoch + 1``, ``consumed = 0``), so a checkpoint taken after the epoch's loop
resumes at the start of the next epoch, and ``set_epoch(epoch + 1)`` is then a no-op.

Replicas. Without ``num_replicas``/``rank`` the sampler takes them from the process group. Built before
the group exists (a framework such as Lightning creates it inside ``fit()``), it resolves them again
when it is used (iterated, measured, saved or restored) and logs the change: a sampler built too early
must not silently read every sample on every rank.

Length. ``length="remaining"`` (the default): ``len()`` is what ``iter()`` yields from the current
position, so a plain loop's ``len(loader)`` after a resume is the batches it will get. ``length="epoch"``:
``len()`` is the whole epoch's share of a rank, as DistributedSampler's, for loops that count their own
position in the epoch and measure the epoch once (Lightning's fit loop); ``iter()`` at the end of an
epoch then starts the next epoch, because such a loop asks for the next epoch's iterator before it sets
the epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

from resilient_slurm.checkpoint.workers import protect_dataloader
from resilient_slurm.errors import ConfigError, IncompatibleCheckpointError
from resilient_slurm.jobenv import JobEnv

logger = logging.getLogger(__name__)

__all__ = ["ResumableSampler"]

STATE_VERSION = 1
LENGTHS = ("remaining", "epoch")


class ResumableSampler(Sampler[int]):
    """Distributed sampler (DistributedSampler's order) whose mid-epoch position is checkpointable."""

    def __init__(
        self,
        dataset_or_len: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        length: str = "remaining",
    ) -> None:
        """Sample ``dataset_or_len`` (a sized dataset or its length) for ``rank`` of ``num_replicas``.

        ``length``: what ``len()`` means, ``"remaining"`` or ``"epoch"`` (see the module's docstring)."""
        if length not in LENGTHS:
            raise ConfigError(f"length must be one of {', '.join(LENGTHS)}, got {length!r}")
        self.length: str = length
        if isinstance(dataset_or_len, bool):
            raise ConfigError("dataset_or_len must be a sized dataset or a non-negative int, got a bool")
        if isinstance(dataset_or_len, int):
            n = dataset_or_len
        elif isinstance(dataset_or_len, Sized):
            n = len(dataset_or_len)
        else:
            raise ConfigError(
                f"dataset_or_len must be a sized dataset or a non-negative int, got "
                f"{type(dataset_or_len).__name__}; iterable-style datasets cannot be resumed by index"
            )
        if n < 0:
            raise ConfigError(f"dataset_or_len must be >= 0, got {n}")
        distributed = dist.is_available() and dist.is_initialized()
        # Left to the process group but built before it exists: resolved again when used (_resolve).
        self._deferred = not distributed and (num_replicas is None or rank is None)
        self._deferred_warned = False
        if num_replicas is None:
            num_replicas = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if num_replicas < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ConfigError(
                f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}"
            )
        self.dataset_len: int = n
        self.num_replicas: int = num_replicas
        self.rank: int = rank
        self.shuffle: bool = bool(shuffle)
        self.seed: int = int(seed)
        self.drop_last: bool = bool(drop_last)
        self.epoch: int = 0
        # Global count (all ranks) of this epoch's samples the training loop has received.
        self.consumed: int = 0

    # -- replicas ------------------------------------------------------------------------------

    def _resolve(self) -> None:
        """Take the replicas from the process group if it did not exist when this sampler was built."""
        if not self._deferred:
            return
        if dist.is_available() and dist.is_initialized():
            self._deferred = False
            world, rank = dist.get_world_size(), dist.get_rank()
            if (world, rank) != (self.num_replicas, self.rank):
                logger.info(
                    "ResumableSampler was built before the process group existed; it now samples for rank %d "
                    "of %d replicas (it had assumed one replica)", rank, world)
                self.num_replicas, self.rank = world, rank
            return
        if not self._deferred_warned:
            self._deferred_warned = True
            env_world = JobEnv.from_env(warn=False).world_size
            if env_world is not None and env_world > 1:
                logger.warning(
                    "ResumableSampler is used without a process group while WORLD_SIZE=%s: every rank reads "
                    "every sample. Create the process group first (init_distributed()), or pass num_replicas "
                    "and rank", env_world)

    def epoch_length(self) -> int:
        """Samples per rank in a whole epoch (DistributedSampler's ``num_samples``)."""
        self._resolve()
        if self.drop_last:
            return self.dataset_len // self.num_replicas
        return -(-self.dataset_len // self.num_replicas)

    # -- order ---------------------------------------------------------------------------------

    def _epoch_order(self) -> list[int]:
        """The epoch's global order P, independent of the world size."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=generator).tolist()
        return list(range(self.dataset_len))

    def _remaining_global(self, order: list[int]) -> list[int]:
        """The not yet consumed part of the epoch, padded or truncated to divide num_replicas."""
        rest = order[self.consumed :]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.num_replicas]
        padding = -len(rest) % self.num_replicas
        if padding and order:
            # Same padding source as DistributedSampler: repeat the epoch's order from its start.
            repeats = -(-padding // len(order))
            rest += (order * repeats)[:padding]
        return rest

    def _roll_over_if_done(self) -> None:
        """``length="epoch"``: an epoch consumed to its end is left for the next one when iterated again, so a
        loop that creates its iterator before it sets the epoch (Lightning) gets the next epoch's order."""
        if self.length == "epoch" and self.dataset_len and self._remaining_per_rank() == 0:
            logger.debug("epoch %d consumed to its end: iterating epoch %d", self.epoch, self.epoch + 1)
            self.epoch += 1
            self.consumed = 0

    def _remaining_per_rank(self) -> int:
        rest = max(self.dataset_len - self.consumed, 0)
        if self.drop_last:
            return rest // self.num_replicas
        return -(-rest // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        """Yield this rank's indices from the current position to the end of the epoch."""
        self._resolve()
        self._roll_over_if_done()
        # Computed eagerly: the position may advance (through track) while a DataLoader still holds
        # this iterator, and the indices it hands out must not shift under it.
        indices = self._remaining_global(self._epoch_order())[self.rank :: self.num_replicas]
        return iter(indices)

    def __len__(self) -> int:
        """Samples this rank has left in the current epoch, or (``length="epoch"``) in a whole epoch."""
        self._resolve()
        if self.length == "epoch":
            return self.epoch_length()
        return self._remaining_per_rank()

    # -- position ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's order; a different epoch than the current one starts at its beginning."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0
        # Same epoch: keep the position, so the usual `set_epoch(epoch)` at the top of a resumed
        # epoch loop does not throw away the restored mid-epoch position.

    def advance(self, n_samples_per_rank: int) -> None:
        """Mark ``n_samples_per_rank`` more samples per rank as consumed (for loops that bypass track)."""
        self._resolve()
        remaining = self._remaining_per_rank()
        if not 0 <= n_samples_per_rank <= remaining:
            raise ConfigError(
                f"advance({n_samples_per_rank}) is outside [0, {remaining}], the samples rank {self.rank} "
                f"has left in epoch {self.epoch}; count samples per rank, not globally or per batch"
            )
        self.consumed += n_samples_per_rank * self.num_replicas

    def track(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """Yield each batch of ``loader`` (built on this sampler), counting it consumed as it is received."""
        batch_size, drop_last = self._batching_of(loader)
        self._resolve()
        self._roll_over_if_done()
        # The loader draws its indices from __iter__ at the current position, so the per-rank count
        # left now is exactly what this pass will hand out (before the loader's own drop_last).
        remaining = self._remaining_per_rank()
        # Creating a DataLoader iterator draws the workers' base seed from the *global* torch RNG. A
        # resumed run creates its iterator mid-epoch, at another point of that stream, so the draw
        # would shift every later dropout mask. Keep iterator creation RNG-neutral instead: the global
        # stream then depends only on the training steps, with or without a restart in between.
        rng_state = torch.get_rng_state()
        protect_dataloader(loader)  # workers must outlive the signal that asks their rank to save
        batches = iter(loader)
        torch.set_rng_state(rng_state)
        for batch in batches:
            taken = min(batch_size, remaining)
            remaining -= taken
            # Advance before handing the batch over: a checkpoint taken while the loop holds this
            # batch must not replay it. Prefetched batches are not counted, only received ones.
            self.consumed += taken * self.num_replicas
            yield batch
        # The pass ran to its end (a loop that breaks out never gets here). Whatever is left (a
        # partial batch the loader dropped) is skipped on purpose, so the epoch is complete: move to
        # the start of the next one, which a checkpoint taken now will resume from.
        if drop_last and remaining:
            logger.debug("epoch %d: loader dropped a last partial batch of %d samples", self.epoch, remaining)
        self.epoch += 1
        self.consumed = 0

    def _batching_of(self, loader: DataLoader[Any]) -> tuple[int, bool]:
        """Return (batch size, drop_last) of a loader, checking it draws from this sampler."""
        if getattr(loader, "in_order", True) is False:
            # Out-of-order batches would make "k batches received" differ from "the first k batches".
            raise ConfigError(
                "track() needs DataLoader(in_order=True): out-of-order batches cannot be counted"
            )
        batch_sampler = loader.batch_sampler
        if batch_sampler is None:
            if loader.sampler is not self:
                raise ConfigError("track() got a DataLoader whose sampler is not this ResumableSampler")
            return 1, False  # automatic batching disabled: every item is one sample
        if not isinstance(batch_sampler, BatchSampler) or batch_sampler.sampler is not self:
            raise ConfigError(
                "track() got a DataLoader that does not draw from this ResumableSampler; build it with "
                "DataLoader(dataset, batch_size=..., sampler=this_sampler)"
            )
        return batch_sampler.batch_size, batch_sampler.drop_last

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return the position and the settings it depends on, as plain values."""
        self._resolve()
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "num_replicas": self.num_replicas,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`, possibly saved with a different number of replicas."""
        if not isinstance(state, Mapping):
            raise IncompatibleCheckpointError(
                f"sampler state must be a mapping, got {type(state).__name__}; the checkpoint is damaged"
            )
        self._resolve()

        def field(name: str, kind: type) -> Any:
            if name not in state:
                raise IncompatibleCheckpointError(
                    f"sampler state lacks {name!r}; it was not written by ResumableSampler.state_dict()"
                )
            value = state[name]
            # bool is an int subclass; a bool where an int belongs means a damaged or foreign state.
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise IncompatibleCheckpointError(
                    f"sampler state field {name!r} must be {kind.__name__}, got {value!r}"
                )
            return value

        version = field("version", int)
        if version != STATE_VERSION:
            raise IncompatibleCheckpointError(
                f"sampler state version {version} is not supported (this library reads {STATE_VERSION}); "
                "restore with the resilient_slurm version that wrote it"
            )
        epoch = field("epoch", int)
        consumed = field("consumed", int)
        seed = field("seed", int)
        shuffle = field("shuffle", bool)
        dataset_len = field("dataset_len", int)
        saved_replicas = field("num_replicas", int)
        saved_drop_last = field("drop_last", bool)

        if dataset_len != self.dataset_len:
            raise IncompatibleCheckpointError(
                f"sampler state field 'dataset_len' is {dataset_len} but the dataset now has "
                f"{self.dataset_len} samples; a position in one dataset means nothing in another: "
                "restore with the same dataset, or leave the sampler out of the restored state to start "
                "its epoch afresh"
            )
        if seed != self.seed:
            raise IncompatibleCheckpointError(
                f"sampler state field 'seed' is {seed} but this sampler has seed={self.seed}; the order "
                f"would differ and samples would repeat or be skipped: construct it with seed={seed}"
            )
        if shuffle != self.shuffle:
            raise IncompatibleCheckpointError(
                f"sampler state field 'shuffle' is {shuffle} but this sampler has shuffle={self.shuffle}; "
                f"construct it with shuffle={shuffle}"
            )
        if saved_replicas < 1:
            raise IncompatibleCheckpointError(
                f"sampler state field 'num_replicas' must be >= 1, got {saved_replicas}"
            )
        # The saved world's last position is its padded epoch length, below dataset_len + num_replicas.
        if epoch < 0 or not 0 <= consumed < dataset_len + saved_replicas:
            raise IncompatibleCheckpointError(
                f"sampler state position (epoch={epoch}, consumed={consumed}) is out of range for "
                f"{dataset_len} samples on {saved_replicas} replicas; the checkpoint is damaged"
            )
        if saved_replicas != self.num_replicas or saved_drop_last != self.drop_last:
            logger.info(
                "sampler state saved with num_replicas=%d drop_last=%s, resuming with num_replicas=%d "
                "drop_last=%s at global sample %d of epoch %d",
                saved_replicas,
                saved_drop_last,
                self.num_replicas,
                self.drop_last,
                consumed,
                epoch,
            )
        self.epoch = epoch
        self.consumed = consumed
