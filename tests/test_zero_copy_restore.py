"""Zero-copy restore: a large tensor is read into a buffer of its own, verified, and that buffer becomes the
live tensor's memory (same tensor object, new storage) instead of being copied into it.

What must hold, on real files with real Checkpointers (one process, no process group): values equal to
what was saved; every object the program holds (parameters, the optimizer's references and moments,
tied weights) stays the same object and keeps training bitwise like the original; anything whose memory
is shared (a view of a parameter, shared memory, tensors two keys point at) is copied, not taken over,
so the sharing survives; a corrupt step takes nothing over; exported tensors do not drag a neighbour's
memory along (torch.save, safetensors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint import restore as restore_mod

RUN = "z"
BIG = 1024  # Linear(BIG, BIG): 4 MiB of float32, over restore_mod.ADOPT_MIN_BYTES


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(BIG, BIG)
        self.b = torch.nn.Linear(BIG, 8)
        self.register_buffer("scale", torch.ones(BIG, 512))  # a 2 MiB buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.scale[:, 0])


def trained(seed: int, steps: int = 2) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        net(torch.randn(4, BIG)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        net.scale.mul_(1.0 + seed)
    return net, opt


def save(root: Path, step: int, state: dict[str, Any]) -> None:
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=5) as ck:
        ck.save(step, state)
        ck.wait()


def restore(root: Path, state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=5) as ck:
        step = ck.restore(state)
    events = [json.loads(line) for line in (root / RUN / "events.jsonl").read_text().splitlines()]
    return step, [e for e in events if e["event"] == "restore"][-1]


def tensors(net: Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(net.state_dict().values())
    for st in opt.state_dict()["state"].values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def one_step(net: Net, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    torch.manual_seed(123)
    net(torch.randn(4, BIG)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [t.clone() for t in tensors(net, opt)]


def test_large_tensors_take_over_the_read_buffers_and_train_on_bitwise(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 2, {"model": net, "optim": opt})
    fresh, fopt = trained(7, steps=1)
    params = list(fresh.parameters())
    ptrs = {id(p): p.data_ptr() for p in params}
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 2
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))
    # The same objects, the optimizer still pointing at them, but new memory for the large ones.
    assert list(fresh.parameters()) == params and all(a is b for a, b in zip(fresh.parameters(), params))
    assert all(p is q for p, q in zip(fopt.param_groups[0]["params"], params))
    assert fresh.a.weight.data_ptr() != ptrs[id(fresh.a.weight)]
    assert fresh.b.bias.data_ptr() == ptrs[id(fresh.b.bias)]  # 32 bytes: copied
    big = sum(t.numel() * t.element_size() for t in tensors(fresh, fopt) if t.numel() * 4 >= restore_mod.ADOPT_MIN_BYTES)
    assert event["adopted_bytes"] == big > 0
    # Each adopted tensor has memory of its own (not one storage shared by all of them).
    storages = {t.untyped_storage().data_ptr() for t in (fresh.a.weight, fresh.scale, fopt.state[fresh.a.weight]["exp_avg"])}
    assert len(storages) == 3
    assert fresh.a.weight.requires_grad and isinstance(fresh.a.weight, torch.nn.Parameter)
    # Training goes on exactly as it would have from the saved state.
    after = one_step(fresh, fopt)
    assert all(torch.equal(x, y) for x, y in zip(one_step(net, opt), after))


def test_shared_memory_is_copied_into_so_the_sharing_survives(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt, "extra": torch.full((BIG, BIG), 3.0)})

    class Tied(Net):
        def __init__(self) -> None:
            super().__init__()
            self.c = self.a  # the same Linear twice: two state_dict keys, one parameter

    torch.manual_seed(1)
    saved_tied = Tied()
    save(tmp_path / "tied", 1, {"model": saved_tied})
    fresh_tied = Tied()
    restore(tmp_path / "tied", {"model": fresh_tied})
    assert fresh_tied.c.weight is fresh_tied.a.weight
    assert torch.equal(fresh_tied.a.weight, saved_tied.a.weight)

    fresh, fopt = trained(5)
    ptr = fresh.a.weight.data_ptr()
    view = fresh.a.weight.detach()[:, :8]  # a view the program keeps: it must go on seeing the parameter
    extra = torch.zeros(BIG, BIG).share_memory_()
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt, "extra": extra})
    assert step == 1
    assert extra.is_shared() and torch.equal(extra, torch.full((BIG, BIG), 3.0))
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))
    assert fresh.a.weight.data_ptr() == ptr and torch.equal(view, net.a.weight.detach()[:, :8])
    assert 0 < event["adopted_bytes"]  # the rest (the buffer, the moments) was still taken over


def test_a_corrupt_step_takes_nothing_over(tmp_path: Path) -> None:
    net1, opt1 = trained(1)
    save(tmp_path, 1, {"model": net1, "optim": opt1})
    net2, opt2 = trained(2)
    save(tmp_path, 2, {"model": net2, "optim": opt2})
    shard = next((tmp_path / RUN / "step_000000000002").glob("*.distcp"))
    with open(shard, "r+b") as f:  # flip a byte in the last large tensor's bytes
        f.seek(os.path.getsize(shard) - 4096)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    fresh, fopt = trained(9)
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 1
    assert all(torch.equal(x, y) for x, y in zip(tensors(net1, opt1), tensors(fresh, fopt)))
    assert event["adopted_bytes"] > 0
    assert event["skipped"] == [2]


def test_a_second_restore_in_one_process_copies_and_stays_exact(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    fresh, fopt = trained(4)
    restore(tmp_path, {"model": fresh, "optim": fopt})
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    ptr = fresh.a.weight.data_ptr()
    _, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    # The tensors now live in buffers slightly larger than themselves: copied into, not taken over again.
    assert fresh.a.weight.data_ptr() == ptr and event["adopted_bytes"] == 0
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))


def test_state_dict_aliases_of_a_custom_object_are_loaded_through_its_load_state_dict(tmp_path: Path) -> None:
    class Holder:
        def __init__(self, v: float) -> None:
            self.t = torch.full((BIG, 512), v)

        def state_dict(self) -> dict[str, Any]:
            return {"t": self.t.detach()}  # an alias of its own tensor

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.t.copy_(sd["t"])

    save(tmp_path, 1, {"h": Holder(2.5)})
    h = Holder(0.0)
    restore(tmp_path, {"h": h})
    assert torch.equal(h.t, torch.full((BIG, 512), 2.5))


def test_exports_of_adopted_tensors_hold_only_their_own_bytes(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    fresh, fopt = trained(3)
    _, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert event["adopted_bytes"] > 0
    out = tmp_path / "w.pt"
    torch.save(fresh.b.weight, out)  # 32 KiB: must not carry a neighbour's 4 MiB along
    assert os.path.getsize(out) < 2 * fresh.b.weight.numel() * 4 + 8192
    st = pytest.importorskip("safetensors.torch")
    st.save_file({k: v.contiguous() for k, v in fresh.state_dict().items()}, str(tmp_path / "m.safetensors"))
    back = st.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in net.state_dict().items())
