"""ResumableSampler: resume mid-epoch through real DataLoaders (workers), replicas, resizing, bad state."""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient_slurm.checkpoint.sampler import ResumableSampler
from resilient_slurm.errors import ConfigError, IncompatibleCheckpointError

N = 23
SEED = 41
EPOCHS = 3


def _dataset(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _persist(state: dict[str, Any]) -> dict[str, Any]:
    """Send a state through torch.save and a weights_only load, as a checkpoint would."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _order(epoch: int, n: int = N) -> list[int]:
    """The epoch's global order, computed independently of the sampler."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def _run(
    *,
    num_replicas: int,
    rank: int,
    batch_size: int,
    loader_drop_last: bool,
    num_workers: int = 2,
    state: dict[str, Any] | None = None,
    stop_after: int | None = None,
    stop_after_epoch: int | None = None,
) -> tuple[list[list[int]], dict[str, Any]]:
    """A training loop over EPOCHS epochs that may stop after some batches or after an epoch's loop."""
    sampler = ResumableSampler(_dataset(), num_replicas=num_replicas, rank=rank, seed=SEED)
    if state is not None:
        sampler.load_state_dict(_persist(state))
    loader = DataLoader(
        _dataset(),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=loader_drop_last,
        # Workers run well ahead of the loop: the position must still follow the loop.
        prefetch_factor=4 if num_workers else None,
    )
    seen: list[list[int]] = []
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for (batch,) in sampler.track(loader):
            seen.append(batch.tolist())
            if len(seen) == stop_after:
                return seen, sampler.state_dict()
        if epoch == stop_after_epoch:
            return seen, sampler.state_dict()
    return seen, sampler.state_dict()


# (num_replicas, rank, batch_size, loader_drop_last); 23 samples give 8 batches of 3 per epoch on one
# replica (the last one partial, or dropped), 4 of 3 per rank on two replicas.
CONFIGS = [(1, 0, 3, False), (1, 0, 3, True), (2, 1, 3, False)]


@pytest.mark.proc
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "replicas{}-rank{}-bs{}-droplast{}".format(*c))
@pytest.mark.parametrize("stop_after", [0, 1, 3, "end_of_epoch_in_loop", "after_epoch_loop", "next_epoch"])
def test_resume_matches_uninterrupted_run(config: tuple[int, int, int, bool], stop_after: int | str) -> None:
    num_replicas, rank, batch_size, loader_drop_last = config
    common = {
        "num_replicas": num_replicas,
        "rank": rank,
        "batch_size": batch_size,
        "loader_drop_last": loader_drop_last,
    }
    reference, _ = _run(**common)
    per_rank = -(-N // num_replicas)
    batches_per_epoch = per_rank // batch_size if loader_drop_last else -(-per_rank // batch_size)
    assert len(reference) == EPOCHS * batches_per_epoch

    stop_kwargs: dict[str, int] = {}
    if stop_after == "end_of_epoch_in_loop":
        stop_kwargs["stop_after"] = batches_per_epoch
    elif stop_after == "after_epoch_loop":
        stop_kwargs["stop_after_epoch"] = 0
    elif stop_after == "next_epoch":
        stop_kwargs["stop_after"] = batches_per_epoch + 2
    else:
        assert isinstance(stop_after, int)
        stop_kwargs["stop_after"] = stop_after
    if stop_kwargs.get("stop_after") == 0:
        # A checkpoint before the first batch: the fresh sampler's state.
        first = []
        state = ResumableSampler(_dataset(), num_replicas=num_replicas, rank=rank, seed=SEED).state_dict()
    else:
        first, state = _run(**common, **stop_kwargs)

    if stop_after == "after_epoch_loop":
        # The finished epoch's loop leaves the position at the start of the next epoch.
        assert (state["epoch"], state["consumed"]) == (1, 0)
    elif isinstance(stop_after, int) and stop_after > 0:
        # Exactly what the loop received, however far the workers prefetched.
        assert (state["epoch"], state["consumed"]) == (0, stop_after * batch_size * num_replicas)

    rest, _ = _run(**common, state=state)
    assert first + rest == reference


def test_uninterrupted_order_matches_distributed_sampler() -> None:
    for num_replicas in (1, 2, 4):
        for rank in range(num_replicas):
            ours = ResumableSampler(N, num_replicas=num_replicas, rank=rank, seed=SEED)
            theirs = DistributedSampler(_dataset(), num_replicas=num_replicas, rank=rank, seed=SEED)
            for epoch in range(2):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs)
                assert len(ours) == len(theirs)


@pytest.mark.parametrize("n", [24, 23])
def test_two_replicas_cover_disjoint_indices(n: int) -> None:
    samplers = [ResumableSampler(n, num_replicas=2, rank=r, seed=SEED) for r in range(2)]
    loaders = [DataLoader(_dataset(n), batch_size=4, sampler=s, num_workers=0) for s in samplers]
    streams = [
        [i for (batch,) in s.track(loader) for i in batch.tolist()]
        for s, loader in zip(samplers, loaders, strict=True)
    ]
    assert len(streams[0]) == len(streams[1]) == -(-n // 2)
    counts = Counter(streams[0] + streams[1])
    assert set(counts) == set(range(n))
    if n % 2 == 0:
        assert set(streams[0]).isdisjoint(streams[1])
    else:
        # The one padding sample repeats the epoch's first index, like DistributedSampler.
        assert [i for i, c in counts.items() if c > 1] == [_order(0, n)[0]]
        assert streams[1][-1] == _order(0, n)[0]
    # Both ranks finished epoch 0 through track and agree on the position.
    assert samplers[0].state_dict() == samplers[1].state_dict()
    assert (samplers[0].epoch, samplers[0].consumed) == (1, 0)


def _consume(
    num_replicas: int, state: dict[str, Any] | None, batches: int | None
) -> tuple[list[list[int]], dict]:
    """Run every rank of a world through `batches` batches of 2 (all if None); return streams, state."""
    streams: list[list[int]] = []
    states: list[dict[str, Any]] = []
    for rank in range(num_replicas):
        sampler = ResumableSampler(_dataset(), num_replicas=num_replicas, rank=rank, seed=SEED)
        if state is not None:
            sampler.load_state_dict(_persist(state))
        loader = DataLoader(_dataset(), batch_size=2, sampler=sampler, num_workers=0)
        stream: list[int] = []
        for i, (batch,) in enumerate(sampler.track(loader)):
            stream.extend(batch.tolist())
            if batches is not None and i + 1 == batches:
                break
        streams.append(stream)
        states.append(sampler.state_dict())
    # Every rank must checkpoint the same position, whichever rank's shard is read back.
    assert all({k: v for k, v in s.items()} == states[0] for s in states)
    return streams, states[0]


def test_resize_four_to_two_to_three_replicas_sees_each_remaining_sample_once() -> None:
    order = _order(0)
    before, state = _consume(4, None, batches=2)
    assert state["consumed"] == 16
    consumed_so_far = [i for stream in before for i in stream]
    assert sorted(consumed_so_far) == sorted(order[:16])

    # 23 - 16 = 7 samples left for 2 replicas: one padding sample (the epoch's first) evens it out.
    middle, state = _consume(2, state, batches=1)
    assert state["consumed"] == 16 + 2 * 2
    assert [len(s) for s in middle] == [2, 2]

    after, state = _consume(3, state, batches=None)
    assert [len(s) for s in after] == [1, 1, 1]  # 23 - 20 = 3: no padding needed
    assert (state["epoch"], state["consumed"]) == (1, 0)

    everything = consumed_so_far + [i for s in middle + after for i in s]
    assert sorted(everything) == list(range(N))  # no duplicates, no gaps

    # Restoring on 2 replicas without consuming shows the documented padding explicitly.
    _, state16 = _consume(4, None, batches=2)
    rest, _ = _consume(2, state16, batches=None)
    assert sorted(rest[0] + rest[1]) == sorted(order[16:] + [order[0]])
    assert rest[1][-1] == order[0]


def test_len_is_remaining_for_this_rank_and_drives_loader_len() -> None:
    sampler = ResumableSampler(N, num_replicas=2, rank=0, seed=SEED)
    loader = DataLoader(_dataset(), batch_size=3, sampler=sampler)
    assert len(sampler) == 12 and len(loader) == 4
    sampler.advance(5)
    assert len(sampler) == 7 and len(loader) == 3
    assert list(sampler) == list(ResumableSampler(N, num_replicas=2, rank=0, seed=SEED))[5:]


def test_advance_then_restore_in_custom_loop() -> None:
    sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=SEED, shuffle=False)
    taken = list(sampler)[:4]
    sampler.advance(4)
    restored = ResumableSampler(N, num_replicas=1, rank=0, seed=SEED, shuffle=False)
    restored.load_state_dict(_persist(sampler.state_dict()))
    assert taken + list(restored) == list(range(N))
    with pytest.raises(ConfigError, match="advance"):
        restored.advance(N)
    with pytest.raises(ConfigError, match="advance"):
        restored.advance(-1)


def test_set_epoch_keeps_position_for_same_epoch_and_resets_for_new_one() -> None:
    sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=SEED)
    sampler.set_epoch(2)
    sampler.advance(5)
    sampler.set_epoch(2)
    assert sampler.consumed == 5
    sampler.set_epoch(3)
    assert sampler.consumed == 0 and list(sampler) == _order(3)


def test_track_rejects_a_loader_on_another_sampler() -> None:
    sampler = ResumableSampler(N, num_replicas=1, rank=0)
    other = DataLoader(_dataset(), batch_size=2, shuffle=True)
    with pytest.raises(ConfigError, match="does not draw from this ResumableSampler"):
        next(iter(sampler.track(other)))


def test_constructor_defaults_without_process_group_and_validation() -> None:
    sampler = ResumableSampler(_dataset())
    assert (sampler.num_replicas, sampler.rank, sampler.dataset_len) == (1, 0, N)
    with pytest.raises(ConfigError, match="rank"):
        ResumableSampler(N, num_replicas=2, rank=2)
    with pytest.raises(ConfigError, match="num_replicas"):
        ResumableSampler(N, num_replicas=0, rank=0)


def _valid_state() -> dict[str, Any]:
    sampler = ResumableSampler(N, num_replicas=2, rank=0, seed=SEED)
    sampler.advance(3)
    return sampler.state_dict()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"dataset_len": N + 1}, "dataset_len"),
        ({"seed": SEED + 1}, "seed"),
        ({"shuffle": False}, "shuffle"),
        ({"consumed": -2}, "consumed"),
        ({"consumed": N + 2}, "consumed"),
        ({"consumed": "6"}, "consumed"),
        ({"epoch": True}, "epoch"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"version": 99}, "version"),
        ({"seed": None}, "seed"),
    ],
)
def test_bad_state_raises_naming_the_field(change: dict[str, Any], named: str) -> None:
    sampler = ResumableSampler(N, num_replicas=2, rank=0, seed=SEED)
    with pytest.raises(IncompatibleCheckpointError, match=named):
        sampler.load_state_dict({**_valid_state(), **change})
    # A rejected state leaves the position untouched.
    assert (sampler.epoch, sampler.consumed) == (0, 0)


def test_missing_field_and_non_mapping_raise() -> None:
    sampler = ResumableSampler(N, num_replicas=2, rank=0, seed=SEED)
    state = _valid_state()
    del state["epoch"]
    with pytest.raises(IncompatibleCheckpointError, match="epoch"):
        sampler.load_state_dict(state)
    with pytest.raises(IncompatibleCheckpointError):
        sampler.load_state_dict([("epoch", 0)])  # type: ignore[arg-type]


def test_valid_state_loads_and_round_trips() -> None:
    state = _persist(_valid_state())
    sampler = ResumableSampler(N, num_replicas=2, rank=1, seed=SEED)
    sampler.load_state_dict(state)
    assert (sampler.epoch, sampler.consumed) == (0, 6)
    assert all(isinstance(v, (int, bool)) for v in sampler.state_dict().values())
