"""Capture/restore of every RNG: identical draws after restore, weights_only round trip, bad input."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from resilient_slurm.checkpoint.rng import capture_rng_state, restore_rng_state
from resilient_slurm.errors import IncompatibleCheckpointError


def _draw() -> dict[str, object]:
    """Draw from every generator, including the cached-gaussian paths of Python and NumPy."""
    draws: dict[str, object] = {
        "python": [random.random() for _ in range(5)] + [random.gauss(0.0, 1.0)],
        "numpy": np.random.rand(5).tolist() + [float(np.random.standard_normal())],
        "torch": torch.rand(5).tolist() + torch.randn(3).tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        draws["cuda"] = [torch.rand(3, device=f"cuda:{i}").tolist() for i in range(torch.cuda.device_count())]
    return draws


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_restore_reproduces_draws_of_every_generator() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # Leave half-used gaussian caches behind so their capture is exercised too.
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    state = capture_rng_state()
    assert {"python", "numpy", "torch_cpu"} <= set(state)

    first = _draw()
    restore_rng_state(state)
    second = _draw()
    assert first == second
    # And a third draw without restoring must differ, or the test could not fail.
    assert _draw() != first


def test_round_trip_through_weights_only_load() -> None:
    random.seed(10)
    np.random.seed(11)
    torch.manual_seed(12)
    state = capture_rng_state()
    expected = _draw()

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    _draw()  # move every generator away from the captured point
    restore_rng_state(loaded)
    assert _draw() == expected


def test_captured_tensors_do_not_alias_live_generators() -> None:
    torch.manual_seed(5)
    state = capture_rng_state()
    before = [t.clone() for t in _tensors(state)]
    _draw()
    after = _tensors(state)
    assert len(before) == len(after) > 0
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)
    # Mutating the snapshot must not reach the generator either.
    cpu_before = torch.get_rng_state().clone()
    state["torch_cpu"].zero_()  # type: ignore[union-attr]
    assert torch.equal(torch.get_rng_state(), cpu_before)


def test_unknown_keys_are_ignored() -> None:
    torch.manual_seed(7)
    state = capture_rng_state()
    state["some_future_generator"] = {"anything": 1}
    expected = _draw()
    restore_rng_state(state)
    assert _draw() == expected


def test_partial_state_restores_only_what_is_present() -> None:
    torch.manual_seed(8)
    state = {"torch_cpu": capture_rng_state()["torch_cpu"]}
    expected = torch.rand(4)
    restore_rng_state(state)
    assert torch.equal(torch.rand(4), expected)


def _bad(key: str, value: object) -> dict[str, object]:
    state = capture_rng_state()
    if "." in key:
        outer, inner = key.split(".")
        state[outer] = dict(state[outer])  # type: ignore[call-overload]
        state[outer][inner] = value  # type: ignore[index]
    else:
        state[key] = value
    return state


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("python", [1, 2, 3], "python"),
        ("python.state", torch.zeros(10, dtype=torch.int64), "python"),
        ("python.version", 99, "python"),
        ("numpy", "MT19937", "numpy"),
        ("numpy.keys", torch.full((624,), -1, dtype=torch.int64), "numpy"),
        ("numpy.bit_generator", "PCG64", "numpy"),
        ("torch_cpu", torch.zeros(7, dtype=torch.uint8), "torch_cpu"),
        ("torch_cpu", torch.zeros(5056, dtype=torch.float32), "torch_cpu"),
        ("torch_cuda", "not a list", "torch_cuda"),
        # NumPy's own set_state takes these, then reads and writes outside its key array (a crash later).
        ("numpy.pos", 100000, "numpy.pos"),
        ("numpy.pos", -5, "numpy.pos"),
        ("numpy.has_gauss", 7, "numpy"),
        ("numpy.cached_gaussian", "x", "numpy"),
        # Python's setstate takes any gauss_next; random.gauss would return it, or fail mid-training.
        ("python.gauss_next", "abc", "python.gauss_next"),
        ("python.gauss_next", torch.tensor([1.0, 2.0]), "python.gauss_next"),
    ],
)
def test_malformed_entries_raise_naming_the_key(key: str, value: object, named: str) -> None:
    torch.manual_seed(9)
    bad = _bad(key, value)
    expected = torch.rand(3)
    torch.manual_seed(9)
    with pytest.raises(IncompatibleCheckpointError, match=named):
        restore_rng_state(bad)
    # Validation happens before anything is applied, so the generators were left untouched.
    assert torch.equal(torch.rand(3), expected)


def test_missing_field_raises() -> None:
    state = capture_rng_state()
    python_entry = dict(state["python"])  # type: ignore[call-overload]
    del python_entry["gauss_next"]
    state["python"] = python_entry
    with pytest.raises(IncompatibleCheckpointError, match="gauss_next"):
        restore_rng_state(state)


def test_non_mapping_state_raises() -> None:
    with pytest.raises(IncompatibleCheckpointError):
        restore_rng_state([1, 2])  # type: ignore[arg-type]


def test_a_restore_reads_the_generators_saved_whatever_this_process_has(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The restore's target for the RNG state is shaped from the step's metadata, not from this process's own
    generators: a step saved where CUDA generators were in use, restored where none are, restores every other
    generator exactly and says the CUDA ones were not restored (a target taken from this process had no entry
    for them, and dropped them without a word)."""
    import logging

    from resilient_slurm import Checkpointer
    from resilient_slurm.checkpoint import rng as rng_mod

    raw = rng_mod.raw_rng_state
    cuda = [torch.arange(16, dtype=torch.uint8)]  # as torch.cuda.get_rng_state_all() returns them: CPU bytes
    monkeypatch.setattr(rng_mod, "raw_rng_state", lambda: (*raw()[:3], cuda))
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    model = torch.nn.Linear(4, 4)
    with Checkpointer(local_dir=str(tmp_path), run_id="r") as ck:
        ck.save(1, {"model": model})
        ck.wait()
    expected = _draw()
    monkeypatch.setattr(rng_mod, "raw_rng_state", raw)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a process that sees no CUDA device
    random.seed(50)
    np.random.seed(60)
    torch.manual_seed(70)
    with caplog.at_level(logging.WARNING), Checkpointer(local_dir=str(tmp_path), run_id="r") as ck:
        assert ck.restore({"model": torch.nn.Linear(4, 4)}) == 1
    assert _draw() == expected
    assert any("CUDA RNG states for 1 devices but this process sees 0" in r.getMessage() for r in caplog.records)
