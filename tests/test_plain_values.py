"""Plain values (BYTE_IO items) are decoded by planning.load_value: Python's unpickler with a two-class
allow-list for values of Python's own types, torch.load(weights_only=True) for anything else.

The fast path must give exactly the objects torch.load gives (types included), must never accept what
torch's safe loader refuses, and must leave every value it cannot read to torch.load."""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_slurm.checkpoint import planning
from resilient_slurm.checkpoint.planning import load_value


def _saved(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


class _Count:
    """torch.load, counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = torch.load

        def load(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return real(*a, **k)

        monkeypatch.setattr(planning.torch, "load", load)


def _both(value: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int]:
    """``value`` saved with torch.save: what load_value makes of it, what torch.load does, and how many times
    load_value called torch.load."""
    data = _saved(value)
    want = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    count = _Count(monkeypatch)
    return load_value(data), want, count.calls


def _same(a: Any, b: Any) -> None:
    """Equal, and of the same types all the way down (a tuple is not a list, an OrderedDict not a dict)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b  # nan
    else:
        assert a == b and repr(a) == repr(b)


PLAIN = [
    0, -7, 2**100, 2.5, -0.0, float("inf"), float("nan"), True, None, "", "héllo ✓", [], (), {},
    [1, (2, 3), [4.0]], {"a": {"b": [1.0, None]}, 3: "int key"}, {1, 2, 3}, set(),
    collections.OrderedDict([("z", 1), ("a", collections.OrderedDict(b=2))]),
    # what an optimizer's parameter groups and a trainer's counters look like
    [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "maximize": False,
      "foreach": None, "capturable": False, "differentiable": False, "fused": None, "params": list(range(40))}],
    {"epoch": 3, "step": 1200, "names": ["layers.0.w", "layers.1.w"], "shared": [[0, 1]] * 3},
]


@pytest.mark.parametrize("value", PLAIN, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(PLAIN)])
def test_a_value_of_pythons_own_types_decodes_as_torch_load_decodes_it_without_torch_load(
        value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    got, want, calls = _both(value, monkeypatch)
    _same(got, want)
    assert calls == 0, "a value of Python's own types went to torch.load"


NEEDS_TORCH = [b"bytes", bytearray(b"ba"), complex(1, 2), torch.float32, torch.Size([2, 3]), torch.arange(4),
               {"t": torch.ones(2, dtype=torch.bfloat16)}, collections.Counter("abca")]


@pytest.mark.parametrize("value", NEEDS_TORCH, ids=[type(v).__name__ for v in NEEDS_TORCH])
def test_a_value_that_needs_more_than_pythons_own_types_is_read_by_torch_load(
        value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    got, want, calls = _both(value, monkeypatch)
    assert calls == 1
    if type(want) is dict:
        assert torch.equal(got["t"], want["t"]) and got["t"].dtype == want["t"].dtype
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert type(got) is type(want) and got == want


class _Run:
    """Unpickles into a call of a function that leaves a file behind: the attack."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def _zip_of(pkl: bytes, *names: str) -> bytes:
    """A torch.save-shaped zip whose data.pkl (under each of ``names``) is ``pkl``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        names = names or ("archive/data.pkl",)
        for n in names:
            z.writestr(n, pkl)
        z.writestr(names[0].split("/")[0] + "/version", "3\n")
    return buf.getvalue()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_blob_that_would_run_code_runs_none_and_is_refused_whatever_its_shape(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    attacks = {
        "torch.save": _saved(_Run(marker)),
        "protocol 2, by hand": _zip_of(pickle.dumps(_Run(marker), protocol=2)),
        "protocol 4 (STACK_GLOBAL)": _zip_of(pickle.dumps(_Run(marker), protocol=4)),
        # a set built by REDUCE around the call: the allowed class wraps a forbidden one
        "inside an allowed class": _zip_of(pickle.dumps({1: [_Run(marker)]}, protocol=2)),
        "two data.pkl": _zip_of(pickle.dumps(_Run(marker), protocol=2),
                                                    "a/data.pkl", "b/data.pkl"),
    }
    for what, data in attacks.items():
        with pytest.raises((pickle.UnpicklingError, RuntimeError)):  # what torch's safe loader refuses
            load_value(data)
        assert not marker.exists(), f"{what}: the checkpoint ran code"
    pickle.loads(pickle.dumps(_Run(marker)))  # guard: the payload is live
    assert marker.exists()


def test_bytes_that_are_no_torch_save_blob_are_torch_loads_to_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    count = _Count(monkeypatch)
    # a compressed data.pkl (torch.save never writes one; a zip bomb's shape: 16 MiB of pickle in a few KiB) is
    # left to torch.load, as every value was before
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps("x" * (16 << 20), protocol=2))
        z.writestr("archive/version", "3\n")
    assert len(bomb.getvalue()) < 100_000
    assert load_value(bomb.getvalue()) == "x" * (16 << 20)
    assert count.calls == 1
    count.calls = 0
    for data in (b"", b"not a zip", _saved({"a": 1})[:40]):
        with pytest.raises((EOFError, pickle.UnpicklingError, RuntimeError)):  # torch.load's own errors
            load_value(data)
    assert count.calls == 3
    # a storage (persistent id) inside an otherwise plain pickle: torch.load's to read
    data = _saved([1, torch.zeros(1)])
    assert torch.equal(load_value(data)[1], torch.zeros(1)) and count.calls == 4
