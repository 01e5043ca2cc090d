"""In-place restore: a large CPU tensor's bytes are read straight into the live tensor they restore, through a
small ring of aligned buffers, checked against the manifest's xxh3 as they arrive; a step that fails verification
never leaves the state silently mixed.

What must hold, on real files with real Checkpointers (one process, no process group): values equal to what was
saved, in the same memory; every object the program holds (parameters, the optimizer's references and moments,
tied weights, a view it keeps, shared memory) stays what it was and trains on bitwise like the original; a
corrupt newest step is overwritten whole by the older step restored instead; where nothing restores, the restore
raises and names the tensors the failed step was read into, and ``restore_fallback="fresh"`` (which reads into
buffers first) leaves the state as it was; an older step that lacks a tensor the failed one was read into is
refused rather than restored over it. ``read_through`` itself: checksums, order, truncation.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from resilient_slurm import Checkpointer
from resilient_slurm.checkpoint import restore as restore_mod
from resilient_slurm.errors import ConfigError, CorruptCheckpointError, StorageError, UnsafePathError
from resilient_slurm.storage.fileio import BLOCK, Ring, read_spans, read_through

RUN = "z"
BIG = 1024  # Linear(BIG, BIG): 4 MiB of float32, over restore_mod.PLACE_MIN_BYTES


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


def restore(root: Path, state: dict[str, Any], fallback: str = "fail", **kw: Any) -> tuple[int, dict[str, Any]]:
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=5, restore_fallback=fallback) as ck:
        step = ck.restore(state, **kw)
    events = [json.loads(line) for line in (root / RUN / "events.jsonl").read_text().splitlines()]
    return step, [e for e in events if e["event"] in ("restore", "restore_none")][-1]


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


def big_bytes(ts: list[torch.Tensor]) -> int:
    return sum(n for t in ts if (n := t.numel() * t.element_size()) >= restore_mod.PLACE_MIN_BYTES)


def corrupt(root: Path, step: int, t: torch.Tensor) -> None:
    """Flip one byte in the middle of tensor ``t``'s bytes in the step's shard file."""
    shard = next((root / RUN / f"step_{step:012d}").glob("*.distcp"))
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    with open(shard, "r+b") as f:
        at = f.read().index(raw[:4096]) + len(raw) // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_large_tensors_are_read_into_their_own_memory_and_train_on_bitwise(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 2, {"model": net, "optim": opt})
    fresh, fopt = trained(7, steps=1)
    params = list(fresh.parameters())
    ptrs = [t.data_ptr() for t in tensors(fresh, fopt)]
    version, small = fresh.a.weight._version, fresh.b.bias._version
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 2
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))
    # The same objects in the same memory: nothing allocated for them, the optimizer still pointing at them.
    assert all(a is b for a, b in zip(fresh.parameters(), params))
    assert all(p is q for p, q in zip(fopt.param_groups[0]["params"], params))
    assert [t.data_ptr() for t in tensors(fresh, fopt)] == ptrs
    assert event["placed_bytes"] == big_bytes(tensors(fresh, fopt)) > 0
    assert event["bytes"] > event["placed_bytes"]  # the small ones were read into a buffer and copied
    assert fresh.a.weight.requires_grad and isinstance(fresh.a.weight, torch.nn.Parameter)
    assert fresh.a.weight._version > version  # written in place: autograd knows, as after an in-place copy
    assert fresh.b.bias._version > small  # a small one, copied from the buffer by memmove: the same
    # Training goes on exactly as it would have from the saved state.
    after = one_step(fresh, fopt)
    assert all(torch.equal(x, y) for x, y in zip(one_step(net, opt), after))


def test_tensors_stored_in_a_framing_other_than_this_torch_writes_are_parsed_by_torch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large and small tensors alike are copied as they are only when their first bytes are the framing this
    torch writes (a step written by another torch version or by plain DCP may differ): here every framing is made
    to look foreign, so every item takes the other path, collected into a buffer and parsed by torch, and the
    state is restored exactly all the same."""
    from resilient_slurm.checkpoint import apply as apply_mod
    from resilient_slurm.checkpoint.staging import tensor_prefix

    net, opt = trained(1)
    save(tmp_path, 2, {"model": net, "optim": opt})
    fresh, fopt = trained(7, steps=1)

    def other(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
        return bytes(len(tensor_prefix(dtype, shape)))  # same length, other bytes

    monkeypatch.setattr(apply_mod, "tensor_prefix", other)
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 2
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))
    assert event["placed_bytes"] == 0  # nothing was taken for tensor bytes as it arrived


def test_views_shared_memory_tied_weights_and_other_layouts_see_the_restored_values(tmp_path: Path) -> None:
    net, opt = trained(1)
    extra = {"shared": torch.full((BIG, BIG), 3.0), "mapped": torch.full((BIG, BIG), 4.0), "bf16": torch.arange(BIG * BIG).to(torch.bfloat16),
             "wide": torch.arange(BIG * 512, dtype=torch.float32).view(BIG, 512),
             "half": torch.linspace(0, 1, BIG * 512).view(BIG, 512)}
    save(tmp_path, 1, {"model": net, "optim": opt, **extra})

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
    view = fresh.a.weight.detach()[:, :8]  # a view the program keeps: it must go on seeing the parameter
    # A file the program mapped MAP_SHARED (numpy.memmap, torch.from_file(shared=True)): torch's is_shared()
    # says False, yet every byte written there reaches the file.
    backing = tmp_path / "mapped.bin"
    backing.write_bytes(bytes(BIG * BIG * 4))
    with open(backing, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), BIG * BIG * 4, flags=mmap.MAP_SHARED)
    mapped = torch.frombuffer(mapping, dtype=torch.float32).view(BIG, BIG)
    assert not mapped.is_shared()
    mine = {"shared": torch.zeros(BIG, BIG).share_memory_(), "mapped": mapped,
            "bf16": torch.zeros(BIG * BIG, dtype=torch.bfloat16),
            "wide": torch.zeros(512, BIG).t(),  # not contiguous: copied into
            "half": torch.zeros(BIG, 512, dtype=torch.float16)}  # another dtype: converted
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt, **mine})
    assert step == 1
    assert mine["shared"].is_shared() and torch.equal(mine["shared"], extra["shared"])
    assert torch.equal(mine["mapped"], extra["mapped"]) and mine["mapped"].data_ptr() == mapped.data_ptr()
    assert torch.equal(mine["bf16"], extra["bf16"]) and torch.equal(mine["wide"], extra["wide"])
    assert torch.equal(mine["half"], extra["half"].half())
    assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))
    assert torch.equal(view, net.a.weight.detach()[:, :8])
    # Shared memory and shared file mappings are copied into once every rank verified: another process, or
    # the file, must not see unverified bytes.
    assert event["placed_bytes"] == big_bytes([*tensors(fresh, fopt), mine["bf16"]])


def test_a_corrupt_newest_step_is_overwritten_whole_by_the_older_one(tmp_path: Path) -> None:
    net1, opt1 = trained(1)
    save(tmp_path, 1, {"model": net1, "optim": opt1})
    net2, opt2 = trained(2)
    save(tmp_path, 2, {"model": net2, "optim": opt2})
    corrupt(tmp_path, 2, opt2.state[net2.a.weight]["exp_avg"])  # read in place, then found corrupt
    fresh, fopt = trained(9)
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 1 and event["skipped"] == [2]
    assert all(torch.equal(x, y) for x, y in zip(tensors(net1, opt1), tensors(fresh, fopt)))
    assert event["placed_bytes"] > 0
    after = one_step(fresh, fopt)
    assert all(torch.equal(x, y) for x, y in zip(one_step(net1, opt1), after))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["directory", "fifo", "symlink"])
def test_a_shard_that_is_not_a_regular_file_is_named_and_the_older_step_restored(
        what: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A shard replaced by a directory or a FIFO was reported as truncated ("size 4096 bytes, manifest says ..."),
    one replaced by a link was followed. Each is named for what it is, and the older step is restored."""
    net1, opt1 = trained(1)
    save(tmp_path, 1, {"model": net1, "optim": opt1})
    net2, opt2 = trained(2)
    save(tmp_path, 2, {"model": net2, "optim": opt2})
    shard = next((tmp_path / RUN / "step_000000000002").glob("*.distcp"))
    shard.rename(tmp_path / "kept.distcp")
    if what == "directory":
        shard.mkdir()
    elif what == "fifo":
        os.mkfifo(shard)
    else:
        shard.symlink_to(tmp_path / "kept.distcp")  # the right bytes, through a link: never read
    fresh, fopt = trained(9)
    with caplog.at_level(logging.WARNING):
        step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 1 and event["skipped"] == [2]
    kind = {"directory": "a directory", "fifo": "a FIFO (named pipe)", "symlink": "a symlink"}[what]
    assert f"{shard} is {kind}" in caplog.text and "truncated" not in caplog.text, caplog.text
    assert all(torch.equal(x, y) for x, y in zip(tensors(net1, opt1), tensors(fresh, fopt)))


def test_a_step_directory_that_is_a_link_is_named_and_a_new_save_of_the_step_replaces_the_link(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A step directory replaced by a link was skipped without a word, and saving that step again failed to remove
    it ("Cannot call rmtree on a symbolic link"), leaving a temp link behind that no command showed."""
    import shutil

    net1, opt1 = trained(1)
    save(tmp_path, 1, {"model": net1, "optim": opt1})
    net2, opt2 = trained(2)
    save(tmp_path, 2, {"model": net2, "optim": opt2})
    step2 = tmp_path / RUN / "step_000000000002"
    shutil.move(str(step2), tmp_path / "elsewhere")
    step2.symlink_to(tmp_path / "elsewhere")
    fresh, fopt = trained(9)
    with caplog.at_level(logging.WARNING):
        with Checkpointer(local_dir=str(tmp_path), run_id=RUN, keep_last=5) as ck:
            assert ck.restore({"model": fresh, "optim": fopt}) == 1
            assert f"{step2}: a symbolic link or a file where rslurm keeps a step's directory" in caplog.text
            ck.save(2, {"model": fresh, "optim": fopt})
            ck.wait()
    assert step2.is_dir() and not step2.is_symlink() and (tmp_path / "elsewhere" / "manifest.json").is_file()
    assert sorted(p.name for p in (tmp_path / RUN).iterdir() if p.name.startswith("step_")) == [
        "step_000000000001", "step_000000000002"]
    assert "could not remove" not in caplog.text, caplog.text


def test_when_nothing_restores_the_state_read_into_is_named_or_left_untouched(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    corrupt(tmp_path, 1, net.scale)
    fresh, fopt = trained(3)
    with pytest.raises(CorruptCheckpointError) as err:
        restore(tmp_path, {"model": fresh, "optim": fopt})
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "hold bytes of a step that was not restored" in notes and "build the state again" in notes, notes
    assert "model.scale" in notes, notes
    # restore_fallback=fresh reads into buffers first: the state is the program's own, and it starts afresh.
    fresh, fopt = trained(3)
    before = [t.clone() for t in fresh.state_dict().values()]
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt}, fallback="fresh")
    assert step == 0 and event["event"] == "restore_none" and event["skipped"] == [1]
    assert all(torch.equal(x, y) for x, y in zip(before, fresh.state_dict().values()))


def test_an_older_step_that_lacks_a_tensor_the_failed_one_was_read_into_is_refused(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    save(tmp_path, 2, {"model": net, "optim": opt, "late": torch.full((BIG, BIG), 5.0)})
    corrupt(tmp_path, 2, torch.full((BIG, BIG), 5.0))  # read in place into "late", then found corrupt
    fresh, fopt = trained(3)
    late = torch.zeros(BIG, BIG)
    state = {"model": fresh, "optim": fopt, "late": late}
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN, keep_last=5) as ck:
        with pytest.raises(CorruptCheckpointError, match="does not hold late") as err:
            ck.restore(state, allow_missing=["late"])
        assert "Move the failed step aside" in str(err.value)
        assert "late" in "".join(err.value.__notes__)
        # Moving the step aside is not enough in this process: "late" still holds step 2's bytes.
        (tmp_path / RUN / "step_000000000002").rename(tmp_path / "aside")
        with pytest.raises(CorruptCheckpointError, match="does not hold late"):
            ck.restore(state, allow_missing=["late"])
        # Restoring the other tensors alone does not forget it: "late" is still refused afterwards.
        assert ck.restore({"model": fresh, "optim": fopt}) == 1
        with pytest.raises(CorruptCheckpointError, match="does not hold late"):
            ck.restore(state, allow_missing=["late"])
        # With the state built again, step 1 restores ("late" keeps its fresh value).
        del err
        state["late"] = late = torch.zeros(BIG, BIG)
        assert ck.restore(state, allow_missing=["late"]) == 1
        assert torch.equal(late, torch.zeros(BIG, BIG))
        assert all(torch.equal(x, y) for x, y in zip(tensors(net, opt), tensors(fresh, fopt)))


def test_a_write_into_memory_a_dropped_tensor_was_recorded_at_is_recorded_again() -> None:
    """A failed round recorded a tensor the program dropped since; a new tensor got its memory and a later
    failed round writes into it: that write is recorded (the dead entry does not hide it)."""
    from resilient_slurm.checkpoint.apply import Placement, Placing, held, memory_of
    from resilient_slurm.checkpoint.staging import framing_for

    t = torch.zeros(BIG, BIG)
    gone = torch.zeros(1)
    touched = {memory_of(t): ("late", weakref.ref(gone))}  # recorded for a tensor whose memory `t` now has
    del gone
    fr = framing_for(t.dtype, tuple(t.shape))
    blob = bytearray(fr.prefix + bytes([7]) * (t.numel() * 4) + fr.suffix)
    Placing([Placement("late", t, t, t.data_ptr(), t.numel() * 4, len(blob))], touched)(
        0, 0, memoryview(blob))
    assert held(touched, {"late": t}) == {memory_of(t): "late"}


def test_a_failure_while_applying_a_verified_step_says_the_state_is_mixed(tmp_path: Path) -> None:
    class Refuses:
        def state_dict(self) -> dict[str, Any]:
            return {"v": torch.full((4,), 1.0)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            raise ValueError("refused by the program")

    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt, "obj": Refuses()})
    fresh, fopt = trained(3)
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN, keep_last=5) as ck:
        with pytest.raises(ValueError, match="refused by the program") as err:
            ck.restore({"model": fresh, "optim": fopt, "obj": Refuses()})
    notes = "\n".join(err.value.__notes__)
    assert "applying step 1 failed after every rank verified it" in notes, notes
    assert "model.a.weight" in notes, notes  # read into it in place: named


def test_a_tensor_whose_elements_share_memory_is_refused_at_the_save(tmp_path: Path) -> None:
    """An expand()ed tensor saved, verified, and then failed every restore after verification (copy_ into it
    refused, a traceback, the state half applied). The save now refuses it, naming the key; a copy saves and
    restores, and a stride-0 dimension of size 1 (HF's position_ids: arange(n).expand(1, -1)) is no sharing."""
    net, opt = trained(1)
    state: dict[str, Any] = {"model": net, "optim": opt, "mask": torch.ones(1, 4).expand(3, 4),
                             "ids": torch.arange(6).expand(1, -1)}
    with Checkpointer(local_dir=str(tmp_path), run_id=RUN) as ck:
        with pytest.raises(ConfigError, match=r"state 'mask': a tensor whose elements share memory.*x\.clone\(\)"):
            ck.save(1, state)
        assert not list((tmp_path / RUN).glob("step_*"))
        state["mask"] = torch.arange(12.0).view(1, 12).expand(1, 12).reshape(3, 4).clone()
        ck.save(2, state)
        ck.wait()
    fresh, fopt = trained(5)
    back: dict[str, Any] = {"model": fresh, "optim": fopt, "mask": torch.zeros(3, 4), "ids": torch.zeros(1, 6).long()}
    step, _ = restore(tmp_path, back)
    assert step == 2 and torch.equal(back["mask"], state["mask"]) and torch.equal(back["ids"], state["ids"])


def test_a_plain_value_or_a_copy_is_never_read_in_place(tmp_path: Path) -> None:
    """A plain value's tensors are made for the restore, not the program's: nothing of a failed step stays in
    the program's state when one of them fails, and the older step restores."""
    save(tmp_path, 1, {"w": torch.full((BIG, 512), 1.0), "ema": {"v": torch.full((BIG, 512), 1.5)}})
    save(tmp_path, 2, {"w": torch.full((BIG, 512), 2.0), "ema": {"v": torch.full((BIG, 512), 2.5)}})
    corrupt(tmp_path, 2, torch.full((BIG, 512), 2.5))
    state = {"w": torch.zeros(BIG, 512), "ema": {"v": torch.zeros(BIG, 512)}}
    step, event = restore(tmp_path, state)
    assert step == 1 and event["skipped"] == [2]
    assert torch.equal(state["w"], torch.full((BIG, 512), 1.0))
    assert torch.equal(state["ema"]["v"], torch.full((BIG, 512), 1.5))
    assert event["placed_bytes"] == BIG * 512 * 4  # "w" only


def test_a_second_restore_in_one_process_stays_exact(tmp_path: Path) -> None:
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    fresh, fopt = trained(4)
    restore(tmp_path, {"model": fresh, "optim": fopt})
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    ptr = fresh.a.weight.data_ptr()
    _, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert fresh.a.weight.data_ptr() == ptr and event["placed_bytes"] > 0
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


def test_the_moments_of_an_optimizer_not_stepped_yet_are_read_in_place(tmp_path: Path) -> None:
    # A fresh process's state: the model built, its Adam not stepped, so the restore makes the moments; they
    # are read into as well (the live tensors are taken after the load target made them).
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    torch.manual_seed(5)
    net2 = Net()
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    step, ev = restore(tmp_path, {"model": net2, "optim": opt2})
    assert step == 1
    # a.weight and its two moments, and the 2 MiB buffer: everything of 1 MiB or more
    assert ev["placed_bytes"] == 3 * BIG * BIG * 4 + BIG * 512 * 4, ev
    assert all(torch.equal(a, b) for a, b in zip(tensors(net, opt), tensors(net2, opt2)))


def test_an_optimizer_started_afresh_keeps_its_own_large_moments(tmp_path: Path) -> None:
    # The optimizer keyed by index now holds two same-shaped parameters the other way round: allow_missing
    # starts it afresh. The file's large reads (the moments among them, which would fit) are in flight while
    # the small items say so; not one of the moments' bytes may reach the live optimizer.
    def two(seed: int, flip: bool) -> tuple[torch.nn.Module, torch.optim.Adam]:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(BIG, BIG, bias=False), torch.nn.Linear(BIG, BIG, bias=False))
        params = list(net.parameters())
        opt = torch.optim.Adam(params[::-1] if flip else params, lr=1e-2)
        net(torch.randn(4, BIG)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return net, opt

    net, opt = two(1, flip=False)
    save(tmp_path, 1, {"model": net, "optim": opt})
    net2, opt2 = two(2, flip=True)
    own = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt2.state.items()}
    step, ev = restore(tmp_path, {"model": net2, "optim": opt2}, allow_missing=["optim.*"])
    assert step == 1 and ev["placed_bytes"] >= 2 * BIG * BIG * 4  # the model's weights
    for a, b in zip(net.state_dict().values(), net2.state_dict().values()):
        assert torch.equal(a, b)
    assert {id(p) for p in opt2.state} == set(own)
    for p, st in opt2.state.items():
        for k, v in st.items():
            assert torch.equal(v, own[id(p)][k]), k


def test_read_through_hands_every_range_over_in_order_with_its_checksum(tmp_path: Path) -> None:
    data = os.urandom(5 * BLOCK * 1000 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    # Unaligned offsets and lengths, a range spanning many pieces, an empty one, two sharing a block.
    items = [(17, 100), (1000, 3 * BLOCK * 1000), (BLOCK * 4000, 0), (BLOCK * 4000 + 5, 7000), (BLOCK * 4001 + 1, 9)]
    got: list[bytearray] = [bytearray() for _ in items]
    order: list[int] = []

    def sink(k: int, at: int, view: memoryview) -> None:
        assert at == len(got[k])
        got[k] += view
        order.append(k)

    # A ring warmed on its thread while the caller goes on, then used by two reads in a row (restore's files).
    ring = Ring(64 * BLOCK, 3).warm()
    for _ in range(2):
        got[:] = [bytearray() for _ in items]
        order.clear()
        sums = read_through(str(path), len(data), items, sink, threads=3, ring=ring, handover=5 * BLOCK)
        assert [bytes(g) for g in got] == [data[o : o + n] for o, n in items]
        assert order == sorted(order)
        assert sums == [xxhash.xxh3_64_hexdigest(data[o : o + n]) for o, n in items]
    with pytest.raises(StorageError, match="truncated"):
        read_through(str(path), len(data) + BLOCK, [(len(data) - 10, 100)], sink)
    os.truncate(path, len(data) - 50)  # shorter than the caller was told
    with pytest.raises(StorageError, match="short read"):
        read_through(str(path), len(data), [(len(data) - 200, 200)], lambda *a: None)


def test_a_read_waits_only_for_a_free_ring_slot_and_makes_one_the_warming_did_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first reads start once a slot is made, while the ring's thread still faults in the later ones
    (restore's reads do not wait for the whole ring); where the warming failed, a read that finds no slot free
    makes one."""
    import threading

    from resilient_slurm.storage import fileio

    data = os.urandom(2 * 64 * BLOCK)  # two pieces: slots 0 and 1 of a ring of 3
    path = tmp_path / "f"
    path.write_bytes(data)
    release = threading.Event()
    made = fileio.Ring._make

    def slow_make(self: Ring, i: int, prefault: bool = False) -> None:
        if i == 2 and threading.current_thread().name == "rslurm-ring":
            release.wait(120)  # the warming thread is stuck on the slot no read of this file needs
        made(self, i, prefault)

    monkeypatch.setattr(fileio.Ring, "_make", slow_make)
    ring = Ring(64 * BLOCK, 3).warm()
    got = bytearray()
    done = threading.Event()

    def read() -> None:
        read_through(str(path), len(data), [(0, len(data))], lambda k, at, view: got.extend(view), threads=2,
                     ring=ring)
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    finished = done.wait(60)  # a read that waited for the whole ring would wait for `release`
    release.set()
    reader.join(60)
    assert finished and bytes(got) == data

    def failing_make(self: Ring, i: int, prefault: bool = False) -> None:
        if threading.current_thread().name == "rslurm-ring" and i == 1:
            raise OSError("no memory for the ring now")
        made(self, i, prefault)

    monkeypatch.setattr(fileio.Ring, "_make", failing_make)
    got.clear()
    ring = Ring(64 * BLOCK, 3).warm()
    assert ring.warm() is ring  # warmed once: a second call starts no second thread
    read_through(str(path), len(data), [(0, len(data))], lambda k, at, view: got.extend(view), threads=2,
                 ring=ring)
    ring.done()
    assert bytes(got) == data
    assert ring._warming is not None and not ring._warming.is_alive()  # no slot is faulted in past done()

    def warming_fails(self: Ring, i: int, prefault: bool = False) -> None:
        if threading.current_thread().name == "rslurm-ring":
            raise OSError("no memory for the ring now")
        made(self, i, prefault)

    # A ring of one slot whose warming failed on it: the read makes that slot itself (it is not lost).
    monkeypatch.setattr(fileio.Ring, "_make", warming_fails)
    got.clear()
    ring = Ring(64 * BLOCK, 1).warm()
    reader = threading.Thread(target=lambda: read_through(str(path), len(data), [(0, len(data))],
                                                          lambda k, at, view: got.extend(view), ring=ring), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive() and bytes(got) == data


def test_reads_go_on_through_the_ring_slots_made_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read takes whichever slot is free: with the warming thread stuck after the first slot (memory that the
    host backs slowly), every piece of the file is read through that one slot, in order, and its bytes are
    whole; the slots in use are given back, so the ring serves a second file."""
    import threading

    from resilient_slurm.storage import fileio

    data = os.urandom(5 * 64 * BLOCK + 77)  # six pieces of a ring of 3 slots
    path = tmp_path / "f"
    path.write_bytes(data)
    release = threading.Event()
    made = fileio.Ring._make

    def stuck_make(self: Ring, i: int, prefault: bool = False) -> None:
        if i == 1 and threading.current_thread().name == "rslurm-ring":
            release.wait(120)
        made(self, i, prefault)

    monkeypatch.setattr(fileio.Ring, "_make", stuck_make)
    ring = Ring(64 * BLOCK, 3).warm()
    results: list[bytes] = []
    done = threading.Event()

    def read() -> None:
        for _ in range(2):
            got = bytearray()
            read_through(str(path), len(data), [(0, len(data))], lambda k, at, view, got=got: got.extend(view),
                         threads=3, ring=ring)
            results.append(bytes(got))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    finished = done.wait(60)  # reads that each waited for a slot of their own would wait for `release`
    release.set()
    reader.join(60)
    assert finished and results == [data, data]

    def failing_sink(k: int, at: int, view: memoryview) -> None:
        if at >= 64 * BLOCK:
            raise RuntimeError("the sink gave up")

    with pytest.raises(RuntimeError, match="gave up"):  # reads in flight when the sink fails give their slots back
        read_through(str(path), len(data), [(0, len(data))], failing_sink, threads=3, ring=ring)
    ring.done()
    assert sorted(ring._free.get_nowait() for _ in range(ring.slots)) == [0, 1, 2]


def test_a_slot_is_read_into_again_only_once_its_hash_is_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of several requests is hashed on a thread of its own while the caller's thread hands the bytes
    over: with that thread slowed down, a slot given back before its hash was over would be read into by a
    later request and its checksum would be of other bytes. A sink that fails while a hash is under way still
    gets every slot back, and no reader or hash thread outlives the read."""
    import threading
    import time

    from resilient_slurm.storage import fileio

    data = os.urandom(7 * 64 * BLOCK + 333)  # eight pieces through a ring of two slots
    path = tmp_path / "f"
    path.write_bytes(data)
    hashed = fileio._update_all
    on: list[str] = []

    def slow_hash(hashes: list[Any], parts: list[Any]) -> None:
        on.append(threading.current_thread().name)
        time.sleep(0.05)
        hashed(hashes, parts)

    monkeypatch.setattr(fileio, "_update_all", slow_hash)
    ring = Ring(64 * BLOCK, 2).warm()
    items = [(0, 64 * BLOCK + 5), (64 * BLOCK + 5, len(data) - 64 * BLOCK - 5)]
    got = [bytearray(), bytearray()]
    sums = read_through(str(path), len(data), items, lambda k, at, view: got[k].extend(view), threads=2, ring=ring)
    assert [bytes(g) for g in got] == [data[o : o + n] for o, n in items]
    assert sums == [xxhash.xxh3_64_hexdigest(data[o : o + n]) for o, n in items]
    assert on and all(name.startswith("rslurm-hash") for name in on)  # the hash was not on the caller's thread

    def failing_sink(k: int, at: int, view: memoryview) -> None:
        if k == 1 and at >= 2 * 64 * BLOCK:
            raise RuntimeError("the sink gave up")

    with pytest.raises(RuntimeError, match="gave up"):
        read_through(str(path), len(data), items, failing_sink, threads=2, ring=ring)
    ring.done()
    assert sorted(ring._free.get_nowait() for _ in range(ring.slots)) == [0, 1]
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("rslurm-hash", "rslurm-read"))]
    # A file of one request is hashed on the caller's thread, as it is handed over.
    on.clear()
    small = [(0, 1000)]
    assert read_through(str(path), 1000, small, lambda *a: None) == [xxhash.xxh3_64_hexdigest(data[:1000])]
    assert on == []


def test_reads_queued_ahead_and_closed_unused_hand_nothing_over(tmp_path: Path) -> None:
    """``ReadThrough.start`` queues a file's first reads while the caller does other work (restore: while it
    reads and checks the small items); closed without :meth:`finish` (those checks failed), nothing is handed to
    a sink, every slot is free again, the file is closed, and the same ring serves the next read whole."""
    import threading

    from resilient_slurm.storage.fileio import ReadThrough

    data = os.urandom(5 * 64 * BLOCK)
    path = tmp_path / "f"
    path.write_bytes(data)
    ring = Ring(64 * BLOCK, 3).warm()
    fds = len(os.listdir("/proc/self/fd"))
    reads = ReadThrough(str(path), len(data), [(0, len(data))], threads=2, ring=ring)
    reads.start()
    reads.start()  # once: a second call queues nothing more
    assert len(reads._pending) == 3
    for f in list(reads._pending.values()):
        f.result(timeout=60)  # the reads ahead are done: they fill the ring, and wait for the caller
    reads.close()
    reads.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert sorted(ring._free.get_nowait() for _ in range(ring.slots)) == [0, 1, 2]
    for i in range(ring.slots):
        ring.release(i)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("rslurm-read")]
    got = bytearray()
    with ReadThrough(str(path), len(data), [(0, len(data))], threads=2, ring=ring) as again:
        again.start()
        sums = again.finish(lambda k, at, view: got.extend(view))
    assert bytes(got) == data and sums == [xxhash.xxh3_64_hexdigest(data)]
    ring.done()


def open_files() -> list[str]:
    """What this process's file descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor of the listing itself, closed since
            pass
    return out


def recording(events: list[Any], method: Any, what: Any) -> Any:
    """``method`` that first appends ``what(self)`` to ``events`` (to patch over it: the calls, in order)."""
    def run(self: Any, *a: Any, **kw: Any) -> Any:
        events.append(what(self))
        return method(self, *a, **kw)
    return run


def test_the_first_files_large_reads_are_queued_before_the_small_items_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Restore queues the first file's ring reads, then reads and checks the small items (the disk is not idle
    meanwhile), and only then writes into the live tensors. A small item found corrupt stops the step before any
    live tensor is written: the state is the program's own, and the reads queued ahead are closed (no reader
    thread left, the shard's file closed)."""
    import threading

    from resilient_slurm.checkpoint import restore_round
    from resilient_slurm.storage import fileio

    events: list[str] = []
    started, finished, small = fileio.ReadThrough.start, fileio.ReadThrough.finish, restore_round.StepReader._read_small

    monkeypatch.setattr(fileio.ReadThrough, "start", recording(events, started, lambda _: "start"))
    monkeypatch.setattr(fileio.ReadThrough, "finish", recording(events, finished, lambda _: "finish"))
    monkeypatch.setattr(restore_round.StepReader, "_read_small", recording(events, small, lambda _: "small"))
    net, opt = trained(1)
    save(tmp_path, 1, {"model": net, "optim": opt})
    fresh, fopt = trained(3)
    step, ev = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert step == 1 and ev["placed_bytes"] > 0
    assert events[:2] == ["start", "small"] and events[2:].count("finish") == 1, events
    assert all(torch.equal(a, b) for a, b in zip(tensors(net, opt), tensors(fresh, fopt)))

    corrupt(tmp_path, 1, net.b.bias)  # 32 bytes: read with the small items
    fresh, fopt = trained(3)
    before = [t.clone() for t in tensors(fresh, fopt)]
    events.clear()
    assert not [f for f in open_files() if f.endswith(".distcp")]
    with caplog.at_level(logging.WARNING), pytest.raises(CorruptCheckpointError, match="none could be restored") as err:
        restore(tmp_path, {"model": fresh, "optim": fopt})
    assert "checksum mismatch in model.b.bias" in caplog.text
    assert "hold bytes of a step" not in "\n".join(getattr(err.value, "__notes__", []))  # no tensor was written
    assert events == ["start", "small"], events  # the reads were under way, and nothing was handed over
    assert all(torch.equal(a, b) for a, b in zip(before, tensors(fresh, fopt)))
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("rslurm-read", "rslurm-hash"))]
    assert not [f for f in open_files() if f.endswith(".distcp")]  # the shard opened for the reads ahead is closed


@pytest.mark.parametrize("kind", ["directory", "symlink", "FIFO"])
def test_the_readers_read_only_a_regular_file_whoever_checked_the_path_before(tmp_path: Path, kind: str) -> None:
    """Both readers refuse what is not a regular file at the path when they open it (a shard swapped for a link,
    a FIFO or a directory after the caller's check), naming it: never a read through a link, never a hang."""
    data = os.urandom(2 * BLOCK)
    (tmp_path / "real").write_bytes(data)
    path = tmp_path / "shard"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(tmp_path / "real")
    else:
        os.mkfifo(path)
    with pytest.raises(UnsafePathError, match=f"{path} is a {kind}.*, not a regular file"):
        read_through(str(path), len(data), [(0, BLOCK)], lambda k, at, view: None)
    with pytest.raises(UnsafePathError, match=f"{path} is a {kind}.*, not a regular file"):
        read_spans(str(path), [(0, memoryview(bytearray(BLOCK)))], len(data))


@pytest.mark.parametrize("persists", [False, True])
def test_a_read_error_that_passes_is_read_again_and_one_that_persists_skips_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persists: bool) -> None:
    """An EIO of the newest step's files: once for each piece (a disk or filesystem that recovers), the step is
    read again and restored; on every attempt, it is skipped and the older step overwrites what was read in place."""
    import errno

    from resilient_slurm.storage import fileio

    net1, opt1 = trained(1)
    save(tmp_path, 1, {"model": net1, "optim": opt1})
    net2, opt2 = trained(2)
    save(tmp_path, 2, {"model": net2, "optim": opt2})
    monkeypatch.setattr(fileio, "READ_RETRY_PAUSES", (0.0, 0.0))
    real, failed = os.preadv, []

    def flaky(fd: int, bufs: Any, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "step_000000000002" in path and (persists or (path, offset) not in failed):
            failed.append((path, offset))
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    fresh, fopt = trained(9)
    step, event = restore(tmp_path, {"model": fresh, "optim": fopt})
    assert failed
    want = (net1, opt1) if persists else (net2, opt2)
    assert (step, event["skipped"]) == ((1, [2]) if persists else (2, []))
    assert all(torch.equal(x, y) for x, y in zip(tensors(*want), tensors(fresh, fopt)))
    assert event["placed_bytes"] > 0


def test_read_spans_returns_each_range_checksum_in_order_across_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges hashed in batches come back in the caller's order: small and large ones mixed, out of file
    order, empty ones, and ranges of a span past the file's end (it asked for nothing: nothing to wait for)."""
    from resilient_slurm.storage import fileio

    monkeypatch.setattr(fileio, "_HASH_BATCH", 3 * BLOCK)  # a few ranges per batch
    data = os.urandom(40 * BLOCK + 77)
    path = tmp_path / "f"
    path.write_bytes(data)
    a = fileio.aligned_buffer(24 * BLOCK, prefault=False)
    b = fileio.aligned_buffer(17 * BLOCK, prefault=False)
    c = fileio.aligned_buffer(BLOCK, prefault=False)
    spans = [(0, fileio.as_memoryview(a)), (24 * BLOCK, fileio.as_memoryview(b)),
             (48 * BLOCK, fileio.as_memoryview(c))]  # the last lies past the end of the file
    ranges = [(1, 5, 2 * BLOCK), (0, 0, 100), (0, 3 * BLOCK, 20 * BLOCK), (2, 0, 0), (0, 100, 0), (1, 0, 17),
              (1, 16 * BLOCK, 77), (0, 23 * BLOCK, BLOCK)]
    sums = fileio.read_spans(str(path), spans, len(data), threads=3, ranges=ranges)
    want = [xxhash.xxh3_64_hexdigest(data[spans[i][0] + off : spans[i][0] + off + n]) for i, off, n in ranges]
    assert sums == want
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    e = fileio.aligned_buffer(BLOCK, prefault=False)
    assert fileio.read_spans(str(empty), [(0, fileio.as_memoryview(e))], 0, ranges=[(0, 0, 0)]) == [
        xxhash.xxh3_64_hexdigest(b"")]


# ---------------------------------------------------------------- across ranks (gloo, real processes)

WORKER = str(Path(__file__).parent / "workers" / "in_place_worker.py")
TWO_NODES = [{"RSLURM_NODE_NAME": "n1"}, {"RSLURM_NODE_NAME": "n2"}]


def _ranks(mode: str, tmp: Path) -> list[dict[Any, Any]]:
    from conftest import run_ranks

    out = tmp / "out"
    out.mkdir(exist_ok=True)
    run_ranks([WORKER, mode, "--local-dir", str(tmp / "nvme" / "%n"), "--out", str(out)], 2, tmp, timeout=180,
              env={"RSLURM_COLLECTIVE_TIMEOUT": "60"}, per_rank_env=TWO_NODES)
    return [torch.load(out / f"{mode}_rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.proc
def test_a_step_corrupt_on_another_rank_is_overwritten_by_the_older_one_on_every_rank(tmp_path: Path) -> None:
    saved = _ranks("save", tmp_path)
    events = tmp_path / "nvme" / "n1" / "inplace" / "events.jsonl"
    # Rank 1's copy of step 2 is corrupt: rank 0 reads its own (valid) step 2 into its tensors, verifies it,
    # hears rank 1's verdict, and reads step 1 over it, like rank 1.
    shard = next((tmp_path / "nvme" / "n2" / "inplace" / "step_000000000002").glob("*.distcp"))
    raw = saved[1][2]["mine"].view(-1).view(torch.uint8).numpy().tobytes()
    with open(shard, "r+b") as f:
        at = f.read().index(raw[:4096]) + len(raw) // 2
        f.seek(at)
        f.write(b"\xff\xfe")
    got = _ranks("restore", tmp_path)
    for r in range(2):
        assert got[r]["step"] == 1, got[r].get("error")
        assert set(got[r]["tensors"]) == set(saved[r][1])
        for k, v in saved[r][1].items():
            assert torch.equal(got[r]["tensors"][k], v), (r, k)
    restored = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "restore"][-1]
    assert restored["skipped"] == [2] and restored["placed_bytes"] >= 4 * BIG * BIG * 3
    # No older step: every rank raises, and rank 0, which read step 2 into its tensors, names them.
    for step_dir in (tmp_path / "nvme").glob("n*/inplace/step_000000000001"):
        for f in step_dir.glob("*.distcp"):
            f.write_bytes(f.read_bytes()[:-100])
    got = _ranks("restore", tmp_path)
    assert all(g["step"] is None and "CorruptCheckpointError" in g["error"] for g in got), [g.get("error") for g in got]
    assert "rank 0: the state's tensors" in got[0]["notes"] and "model.weight" in got[0]["notes"], got[0]["notes"]


@pytest.mark.proc
def test_reads_queued_ahead_for_a_file_left_with_nothing_to_read_give_the_ring_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of one node save a replicated pair of layers and their Adam: each item is stored once, the two
    files sharing them by size. One process restores both files into an optimizer keyed by index whose
    parameters are the other way round (allow_missing starts it afresh), with the optimizer first in its state
    and the weight that shares the first file with two moments not readable in place (a transposed view). The
    first file's large reads, queued ahead (the moments), hold every slot of a two-slot ring when the optimizer
    check drops them: the file is left with nothing to read in place, and the second file's weight must still
    be read (its reads would wait for those slots for good)."""
    import functools
    import threading

    from conftest import run_ranks

    from resilient_slurm.checkpoint import restore_round
    from resilient_slurm.storage import fileio

    out = tmp_path / "out"
    out.mkdir()
    run_ranks([WORKER, "pair", "--local-dir", str(tmp_path / "nvme"), "--out", str(out)], 2, tmp_path, timeout=180,
              env={"RSLURM_COLLECTIVE_TIMEOUT": "60"})
    saved = torch.load(out / "pair_rank0.pt", weights_only=True)
    step_dir = tmp_path / "nvme" / "inplace" / "step_000000000001"
    first = next(step_dir.glob("__0_*.distcp")).name
    held = (step_dir / first).read_bytes()
    # The layout this test is about: the first file holds the first layer's weight and two moments.
    for key in ("model.0.weight", "optim.0.exp_avg_sq", "optim.1.exp_avg"):
        assert saved[key].view(-1).view(torch.uint8).numpy().tobytes()[:4096] in held, key
    del held

    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(BIG, BIG, bias=False), torch.nn.Linear(BIG, BIG, bias=False))
    net[0].weight = torch.nn.Parameter(torch.randn(BIG, BIG).t())  # not contiguous: copied at apply
    opt = torch.optim.Adam([net[1].weight, net[0].weight], lr=1e-2)
    net(torch.randn(4, BIG)).pow(2).sum().backward()
    opt.step()
    own = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}

    calls: list[tuple[str, str]] = []
    for name in ("start", "finish", "close"):
        monkeypatch.setattr(fileio.ReadThrough, name, recording(
            calls, getattr(fileio.ReadThrough, name), lambda reads, name=name: (name, os.path.basename(reads.path))))
    monkeypatch.setattr(restore_round, "Ring", functools.partial(fileio.Ring, slots=2))
    got: dict[str, Any] = {}

    def run() -> None:
        try:
            with Checkpointer(local_dir=str(tmp_path / "nvme"), run_id="inplace") as ck:
                got["step"] = ck.restore({"optim": opt, "model": net}, allow_missing=["optim.*"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), f"the restore hangs: {calls}"
    assert got.get("step") == 1, got
    second = next(step_dir.glob("__1_*.distcp")).name
    # The moments' reads were queued ahead and never handed over; the second file's weight was read in place.
    assert calls[0] == ("start", first) and ("finish", first) not in calls, calls
    assert ("finish", second) in calls, calls
    assert torch.equal(net[0].weight, saved["model.0.weight"]) and torch.equal(net[1].weight, saved["model.1.weight"])
    assert {id(p) for p in opt.state} == set(own)
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, own[id(p)][k]), k


def test_a_note_is_kept_where_exceptions_have_no_add_note() -> None:
    """Python 3.10 has no BaseException.add_note: the note still reaches ``__notes__``."""
    from resilient_slurm.errors import add_note

    class Old(Exception):
        @property
        def add_note(self) -> Any:
            raise AttributeError("add_note")  # as on Python 3.10

    exc = Old("x")
    add_note(exc, "one")
    add_note(exc, "two")
    assert exc.__notes__ == ["one", "two"]
    new = ValueError("y")
    add_note(new, "three")
    assert new.__notes__ == ["three"]
