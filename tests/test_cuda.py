"""CUDA paths of the engine: state on the GPU is staged device-to-host on a side stream into pinned
buffers, and restored bitwise onto the same devices, CUDA RNG streams included.

These tests need a CUDA device and are skipped (with that reason) where there is none, which is the
CI machine; they run on the GPU machine lent to development (docs/testing.md says how and when they
last ran). Everything the CPU suite checks about the same code paths still runs everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilient_slurm import Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(torch.nn.Module):
    """A small transformer-like block: bf16 and fp32 parameters, dropout (so the CUDA RNG matters)."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(4 * d, d))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.attn(x, x, x, need_weights=False)[0])
        h = h + self.mlp(h)
        return self.head(h.to(torch.bfloat16)).float()


def _build(seed: int) -> tuple[Block, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = Block().cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: Block, opt: torch.optim.AdamW, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 32, 256, device="cuda")  # drawn from the CUDA RNG, like dropout masks
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(model: Block, opt: torch.optim.AdamW) -> dict:
    sd = {"model": model.state_dict(), "opt": opt.state_dict()}

    def clone(o):  # type: ignore[no-untyped-def]
        if isinstance(o, torch.Tensor):
            return o.detach().clone()
        if isinstance(o, dict):
            return {k: clone(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clone(v) for v in o]
        return o

    return clone(sd)


def _same(a: object, b: object, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.device == b.device and a.dtype == b.dtype, f"{path}: {a.device}/{a.dtype} vs {b.device}/{b.dtype}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_gpu_state_and_cuda_rng_resume_bitwise(tmp_path: Path) -> None:
    """Save at step 5 on the GPU, train on; a fresh model restored from step 5 (CUDA RNG scrambled
    first) repeats the same losses and ends with the same parameters and AdamW moments, on cuda."""
    model, opt = _build(0)
    _train(model, opt, 5)
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu") as ck:
        ck.save(5, {"model": model, "opt": opt}, blocking=True)
    ref_losses = _train(model, opt, 6)
    ref = _snapshot(model, opt)

    model2, opt2 = _build(1)  # other values
    _train(model2, opt2, 1)  # materialize AdamW state so it has somewhere to load into
    torch.cuda.manual_seed_all(12345)  # the restore must bring the CUDA RNG stream back
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu") as ck:
        assert ck.restore({"model": model2, "opt": opt2}) == 5
    assert next(model2.parameters()).is_cuda
    assert _train(model2, opt2, 6) == ref_losses
    _same(_snapshot(model2, opt2), ref)


def test_async_save_is_not_torn_by_later_gpu_steps(tmp_path: Path) -> None:
    """An asynchronous save returns after staging; kernels that update the parameters right after it
    (queued on the current stream) must not leak into the checkpoint."""
    model, opt = _build(2)
    _train(model, opt, 3)
    at_save = _snapshot(model, opt)
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu-async") as ck:
        ck.save(3, {"model": model, "opt": opt}, blocking=False)
        _train(model, opt, 4)  # in-place updates queued immediately after the save returned
        ck.wait()
    model2, opt2 = _build(3)
    _train(model2, opt2, 1)
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu-async") as ck:
        assert ck.restore({"model": model2, "opt": opt2}) == 3
    _same(_snapshot(model2, opt2), at_save)


@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned"])
def test_restore_copies_on_a_side_stream_after_queued_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          pin: bool) -> None:
    """The restore reads GPU state into host buffers (pageable by default, pinned with PIN_FOR_CUDA) and copies
    it on a side stream that first waits for the program's stream: a model still being written by queued work
    on the current stream when restore is called ends up with the checkpoint's values, not the queued ones,
    bitwise."""
    from resilient_slurm.checkpoint import restore_round as round_mod

    monkeypatch.setattr(round_mod, "PIN_FOR_CUDA", pin)
    pinned: list[bool] = []
    real = round_mod.aligned_buffer

    def spy(nbytes: int, **kw: object) -> torch.Tensor:
        t = real(nbytes, **kw)  # type: ignore[arg-type]
        pinned.append(t.is_pinned())
        return t

    monkeypatch.setattr(round_mod, "aligned_buffer", spy)
    model, opt = _build(0)
    _train(model, opt, 3)
    with Checkpointer(local_dir=str(tmp_path), run_id="pin") as ck:
        ck.save(3, {"model": model, "opt": opt}, blocking=True)
    ref = _snapshot(model, opt)
    model2, opt2 = _build(1)
    _train(model2, opt2, 1)
    big = torch.randn(4096, 4096, device="cuda")
    with torch.no_grad():
        for p in model2.parameters():  # queued on the current stream, still running when restore starts
            p.add_((big @ big).sum() * 0)
    with Checkpointer(local_dir=str(tmp_path), run_id="pin") as ck:
        assert ck.restore({"model": model2, "opt": opt2}) == 3
    assert pinned and any(pinned) == pin, pinned
    _same(_snapshot(model2, opt2), ref)


def test_a_save_in_waves_of_gpu_state_is_not_torn_by_later_gpu_steps(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a host-memory budget (``staging_memory_limit``) a quarter of the state, the save copies GPU
    tensors to the host in waves through one window: every window is copied from the device before the
    save returns, so kernels queued right after it cannot leak into the checkpoint, and the step restores
    bitwise onto the GPU."""
    from resilient_slurm.checkpoint.staging import WaveWriter

    model, opt = _build(4)
    _train(model, opt, 3)
    at_save = _snapshot(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3  # + 2 Adam moments
    monkeypatch.setenv("RSLURM_STAGING_MEMORY_LIMIT", str(state_bytes // 4))
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu-waves") as ck:
        ck.save(3, {"model": model, "opt": opt}, blocking=False)
        assert isinstance(ck._engine._staging, WaveWriter)
        _train(model, opt, 4)  # in-place updates queued immediately after the save returned
        ck.wait()
    monkeypatch.delenv("RSLURM_STAGING_MEMORY_LIMIT")
    model2, opt2 = _build(5)
    _train(model2, opt2, 1)
    with Checkpointer(local_dir=str(tmp_path), run_id="gpu-waves") as ck:
        assert ck.restore({"model": model2, "opt": opt2}) == 3
    _same(_snapshot(model2, opt2), at_save)


def test_restore_copies_to_the_gpu_through_two_pinned_buffers_in_turn(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Host-to-GPU copies of a restore go through two small pinned buffers used in turn (apply._Bounce): with
    64 KiB buffers every large tensor takes many chunks, each buffer refilled only after the copy that read
    it is done, and the state still comes back bitwise; a tensor smaller than BOUNCE_MIN_BYTES is copied
    directly. The program's stream is kept busy (a 1 s GPU sleep) when the restore starts, so the side stream
    holds every copy back while the host fills the buffers: a buffer refilled before its copy ran would put
    the wrong chunk on the GPU."""
    from resilient_slurm.checkpoint import apply as apply_mod

    monkeypatch.setattr(apply_mod, "BOUNCE_BYTES", 64 << 10)
    monkeypatch.setattr(apply_mod, "BOUNCE_MIN_BYTES", 256 << 10)
    counted: list[tuple[int, int]] = []  # (chunks copied, chunks expected) per bounced tensor
    buffers: set[int] = set()
    real = apply_mod._Bounce.copy

    def spy(self: apply_mod._Bounce, dest: torch.Tensor, src: torch.Tensor) -> bool:
        before = self.chunks
        used = real(self, dest, src)
        n = dest.numel() * dest.element_size()
        assert used == (n >= 256 << 10), (tuple(dest.shape), dest.dtype, used)
        if used:
            counted.append((self.chunks - before, -(-n // (64 << 10))))
            buffers.update(b.data_ptr() for b in self.bufs)
        return used

    monkeypatch.setattr(apply_mod._Bounce, "copy", spy)
    model, opt = _build(6)
    _train(model, opt, 2)
    with Checkpointer(local_dir=str(tmp_path), run_id="bounce") as ck:
        ck.save(2, {"model": model, "opt": opt}, blocking=True)
    ref = _snapshot(model, opt)
    model2, opt2 = _build(7)
    _train(model2, opt2, 1)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of GPU cycles on the program's stream
    with Checkpointer(local_dir=str(tmp_path), run_id="bounce") as ck:
        assert ck.restore({"model": model2, "opt": opt2}) == 2
    assert counted and all(got == want for got, want in counted), counted
    assert max(want for _, want in counted) >= 16, counted  # the 1 MiB tensors: 16 chunks each
    assert len(buffers) == 2, buffers  # two buffers, used in turn
    _same(_snapshot(model2, opt2), ref)
