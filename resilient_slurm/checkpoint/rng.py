"""Capture and restore the state of every random number generator a training step may draw from.

The captured state holds only tensors and plain Python values, so it survives ``torch.save`` followed
by ``torch.load(weights_only=True)``: checkpoints are never unpickled without restriction.

Layout of the state (every key is optional on restore)::

    "python":     {"version": int, "state": int64 tensor [625], "gauss_next": float | None}
    "numpy":      {"bit_generator": str, "keys": int64 tensor [624], "pos": int,
                   "has_gauss": int, "cached_gaussian": float}
    "torch_cpu":  uint8 tensor
    "torch_cuda": list of uint8 tensors, one per CUDA device
"""

from __future__ import annotations

import logging
import numbers
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

from resilient_slurm.errors import IncompatibleCheckpointError

try:
    import numpy as np

    # NumPy imports its random module on first use: 15 ms that would fall inside the first restore (which
    # captures and sets its generator's state), paid here instead.
    import numpy.random  # noqa: F401
except ImportError:  # NumPy is optional: without it there is no NumPy generator to capture.
    np = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = ["capture_rng_state", "pack_rng_state", "plan_rng_state", "raw_rng_state", "restore_rng_state"]

PYTHON_KEY = "python"
NUMPY_KEY = "numpy"
TORCH_CPU_KEY = "torch_cpu"
TORCH_CUDA_KEY = "torch_cuda"


def _cuda_in_use() -> bool:
    """True when CUDA generators exist and have been touched in this process."""
    # is_initialized() guards against creating a CUDA context just to read default generator states:
    # a process that never used CUDA has nothing worth saving there, and initializing CUDA would
    # break fork-based DataLoader workers started afterwards.
    return (
        torch.cuda.is_available()
        and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        and torch.cuda.device_count() > 0
    )


def raw_rng_state() -> tuple[Any, Any, torch.Tensor, list[torch.Tensor] | None]:
    """The generators' states as their own APIs return them (copies), without the conversion
    :func:`capture_rng_state` makes: cheap enough to take before every batch. :func:`pack_rng_state`
    turns one into a capture."""
    return (random.getstate(), np.random.get_state(legacy=True) if np is not None else None,
            torch.get_rng_state(), torch.cuda.get_rng_state_all() if _cuda_in_use() else None)


def pack_rng_state(raw: tuple[Any, Any, torch.Tensor, list[torch.Tensor] | None]) -> dict[str, object]:
    """A :func:`raw_rng_state` as a weights_only-safe capture (the layout above)."""
    py, numpy_state, cpu, cuda = raw
    state: dict[str, object] = {}
    version, internal, gauss_next = py
    # Python's Mersenne Twister state is 624 words < 2**32 plus an index, so int64 holds it exactly.
    state[PYTHON_KEY] = {
        "version": int(version),
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss_next,
    }
    if numpy_state is not None:
        bit_generator, keys, pos, has_gauss, cached_gaussian = numpy_state
        state[NUMPY_KEY] = {
            "bit_generator": str(bit_generator),
            # uint32 tensors are not serializable everywhere; int64 holds every uint32 exactly.
            "keys": torch.from_numpy(np.array(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    # clone() so the snapshot never aliases a generator's live buffer, whatever the torch version does.
    state[TORCH_CPU_KEY] = cpu.clone()
    if cuda is not None:
        state[TORCH_CUDA_KEY] = [s.clone() for s in cuda]
    return state


def capture_rng_state() -> dict[str, object]:
    """Return a weights_only-safe snapshot of the Python, NumPy, torch CPU and CUDA generators."""
    return pack_rng_state(raw_rng_state())


def _require_mapping(key: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise IncompatibleCheckpointError(
            f"RNG state entry {key!r} must be a mapping, got {type(value).__name__}; "
            "the checkpoint was not written by capture_rng_state() or is damaged"
        )
    return value


def _require_field(key: str, entry: Mapping[str, Any], field: str) -> Any:
    if field not in entry:
        raise IncompatibleCheckpointError(
            f"RNG state entry {key!r} lacks field {field!r}; the checkpoint was not written by "
            "capture_rng_state() or is damaged"
        )
    return entry[field]


def _require_int_tensor(key: str, value: object, length: int) -> list[int]:
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dim() != 1:
        raise IncompatibleCheckpointError(
            f"RNG state entry {key!r} must hold a 1-D integer tensor, got {value!r:.80}"
        )
    if value.numel() != length:
        raise IncompatibleCheckpointError(
            f"RNG state entry {key!r} holds {value.numel()} words, expected {length}"
        )
    return [int(v) for v in value.tolist()]


def _require_byte_tensor(key: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise IncompatibleCheckpointError(
            f"RNG state entry {key!r} must be a 1-D uint8 tensor, got {value!r:.80}"
        )
    # The generator APIs want a contiguous CPU tensor even for CUDA devices.
    return value.detach().to("cpu").contiguous()


def _plan_python(value: object) -> Callable[[], None]:
    entry = _require_mapping(PYTHON_KEY, value)
    version = _require_field(PYTHON_KEY, entry, "version")
    words = _require_int_tensor(PYTHON_KEY, _require_field(PYTHON_KEY, entry, "state"), 625)
    gauss_next = _require_field(PYTHON_KEY, entry, "gauss_next")
    # setstate takes any object here, and random.gauss would return it (or fail) mid-training.
    if gauss_next is not None and (isinstance(gauss_next, bool) or not isinstance(gauss_next, numbers.Real)):
        raise IncompatibleCheckpointError(f"RNG state entry {PYTHON_KEY}.gauss_next must be None or a float, got "
                                          f"{type(gauss_next).__name__}")
    py_state = (version, tuple(words), None if gauss_next is None else float(gauss_next))
    try:
        # A scratch generator validates everything setstate checks without touching the global one.
        random.Random().setstate(py_state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise IncompatibleCheckpointError(f"RNG state entry {PYTHON_KEY!r} is malformed: {exc}") from exc
    return lambda: random.setstate(py_state)


def _plan_numpy(value: object) -> Callable[[], None] | None:
    entry = _require_mapping(NUMPY_KEY, value)
    bit_generator = _require_field(NUMPY_KEY, entry, "bit_generator")
    keys = _require_int_tensor(NUMPY_KEY, _require_field(NUMPY_KEY, entry, "keys"), 624)
    pos = _require_field(NUMPY_KEY, entry, "pos")
    has_gauss = _require_field(NUMPY_KEY, entry, "has_gauss")
    cached_gaussian = _require_field(NUMPY_KEY, entry, "cached_gaussian")
    if np is None:
        logger.warning("checkpoint holds a NumPy RNG state but NumPy is not installed; not restoring it")
        return None
    if any(k < 0 or k >= 2**32 for k in keys):
        raise IncompatibleCheckpointError(f"RNG state entry {NUMPY_KEY!r} holds key words outside uint32")
    # NumPy's legacy set_state checks neither: a position past the key array reads (and later writes)
    # outside it, and has_gauss is a flag.
    if isinstance(pos, bool) or not isinstance(pos, numbers.Integral) or not 0 <= int(pos) <= 624:
        raise IncompatibleCheckpointError(f"RNG state entry {NUMPY_KEY}.pos must be an integer in 0..624, got {pos!r}")
    if has_gauss not in (0, 1) or isinstance(cached_gaussian, bool) or not isinstance(cached_gaussian, numbers.Real):
        raise IncompatibleCheckpointError(f"RNG state entry {NUMPY_KEY!r} has a malformed cached gaussian "
                                          f"(has_gauss={has_gauss!r}, cached_gaussian={cached_gaussian!r})")
    np_state = (bit_generator, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached_gaussian))
    try:
        np.random.RandomState().set_state(np_state)
    except (TypeError, ValueError, OverflowError) as exc:
        raise IncompatibleCheckpointError(f"RNG state entry {NUMPY_KEY!r} is malformed: {exc}") from exc
    return lambda: np.random.set_state(np_state)


def _plan_torch_cpu(value: object) -> Callable[[], None]:
    cpu_state = _require_byte_tensor(TORCH_CPU_KEY, value)
    try:
        torch.Generator().set_state(cpu_state)
    except RuntimeError as exc:
        raise IncompatibleCheckpointError(f"RNG state entry {TORCH_CPU_KEY!r} is malformed: {exc}") from exc
    return lambda: torch.set_rng_state(cpu_state)


def _plan_torch_cuda(value: object) -> Callable[[], None] | None:
    if not isinstance(value, (list, tuple)):
        raise IncompatibleCheckpointError(
            f"RNG state entry {TORCH_CUDA_KEY!r} must be a list of per-device tensors, "
            f"got {type(value).__name__}"
        )
    states = [_require_byte_tensor(f"{TORCH_CUDA_KEY}[{i}]", s) for i, s in enumerate(value)]
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available != len(states):
        logger.warning(
            "checkpoint holds CUDA RNG states for %d devices but this process sees %d; restoring the "
            "first %d, the others keep their current state",
            len(states),
            available,
            min(available, len(states)),
        )
    if available == 0 or not states:
        return None
    to_restore = states[:available]

    def apply() -> None:
        for device, cuda_state in enumerate(to_restore):
            try:
                torch.cuda.set_rng_state(cuda_state, device)
            except RuntimeError as exc:
                raise IncompatibleCheckpointError(
                    f"RNG state entry {TORCH_CUDA_KEY}[{device}] is malformed: {exc}"
                ) from exc

    return apply


def restore_rng_state(state: Mapping[str, object]) -> None:
    """Restore every generator present in ``state`` (as produced by :func:`capture_rng_state`)."""
    plan_rng_state(state)()


def plan_rng_state(state: Mapping[str, object]) -> Callable[[], None]:
    """Check every entry of ``state`` now (IncompatibleCheckpointError naming the one that is malformed) and
    return what restores them all, for a caller that restores later than it loads."""
    if not isinstance(state, Mapping):
        raise IncompatibleCheckpointError(
            f"RNG state must be a mapping, got {type(state).__name__}; the checkpoint is damaged"
        )
    planners: dict[str, Callable[[object], Callable[[], None] | None]] = {
        PYTHON_KEY: _plan_python,
        NUMPY_KEY: _plan_numpy,
        TORCH_CPU_KEY: _plan_torch_cpu,
        TORCH_CUDA_KEY: _plan_torch_cuda,
    }
    # Validate every entry before applying any, so a malformed checkpoint leaves all generators as
    # they were instead of half restored.
    actions: list[Callable[[], None]] = []
    for key, value in state.items():
        planner = planners.get(key)
        if planner is None:
            # Newer versions may capture more generators; an older reader skipping them is harmless.
            logger.debug("ignoring unknown RNG state entry %r", key)
            continue
        action = planner(value)
        if action is not None:
            actions.append(action)

    def apply() -> None:
        for action in actions:
            action()

    return apply
