"""The POSIX tier never reads, writes or deletes through a symbolic link below its root: a link at any
component, the last one included, is refused; the root itself may be a link, and when that link is pointed
elsewhere after the tier was made, the check and the operation both follow it (an earlier one-syscall check
resolved the root once, at construction, and an attack read, wrote and deleted outside the tier that way).

Every test runs twice: with the check in one ``openat2`` beneath a descriptor of the root opened at each
call (``paths.link_free_below``, issue 29 item 5), and with the per-component walk it falls back to."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest

from resilient_slurm import paths
from resilient_slurm.errors import StorageError, UnsafePathError
from resilient_slurm.storage.posix import PosixTier

HAVE_OPENAT2 = paths._openat2() is not None


@pytest.fixture(params=["openat2", "walk"], autouse=True)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "openat2" and not HAVE_OPENAT2:
        pytest.skip("openat2 is not usable on this kernel (the walk is tested)")
    if request.param == "walk":
        monkeypatch.setattr(paths, "_openat2_state", [None])
    return str(request.param)


def _refuses_read_write_delete(tier: PosixTier, existing: str, new: str) -> None:
    """A read and a delete of ``existing`` and a write of ``new`` are each refused as unsafe."""
    with pytest.raises(UnsafePathError):
        tier.get_bytes(existing)
    with pytest.raises(UnsafePathError):
        tier.put_bytes(new, b"x")
    with pytest.raises(UnsafePathError):
        tier.delete([existing])


def test_the_tier_refuses_links_below_its_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "step").mkdir(parents=True)
    (outside / "step" / "f").write_bytes(b"secret")
    real = tmp_path / "real"
    real.mkdir()
    root = tmp_path / "root-link"
    root.symlink_to(real)  # the root may be a link: the user's choice
    tier = PosixTier(str(root))
    tier.put_bytes("run/step_1/f", b"data")  # new directories, then a new object
    tier.put_bytes("run/step_1/g", b"more")  # a new object in an existing directory
    assert tier.get_bytes("run/step_1/f") == b"data"
    assert (real / "run" / "step_1" / "g").read_bytes() == b"more"
    (real / "run" / "step_2").symlink_to(outside / "step")  # a linked step directory
    (real / "run" / "step_1" / "lf").symlink_to(outside / "step" / "f")  # a linked object
    for key in ("run/step_2/f", "run/step_2/new", "run/step_1/lf"):
        with pytest.raises(UnsafePathError, match="symbolic link"):
            tier._path(key)
    _refuses_read_write_delete(tier, "run/step_2/f", "run/step_2/new")
    assert sorted(p.name for p in (outside / "step").iterdir()) == ["f"]
    assert (outside / "step" / "f").read_bytes() == b"secret"


def test_a_missing_directory_below_a_link_is_still_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "run").symlink_to(tmp_path / "elsewhere")
    tier = PosixTier(str(tmp_path / "root"))
    with pytest.raises(UnsafePathError, match="symbolic link"):
        tier.put_bytes("run/step_1/deep/f", b"x")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_root_link_pointed_elsewhere_after_the_tier_was_made_gives_no_way_out(tmp_path: Path) -> None:
    """The root ``lk/cur/tier`` with ``cur -> A``; then ``cur -> Z``, where ``Z/tier/run/step_1`` is a
    link to a victim directory: nothing is read, written or deleted in the victim."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_bytes(b"VICTIM")
    (tmp_path / "A" / "tier" / "run" / "step_1").mkdir(parents=True)
    (tmp_path / "A" / "tier" / "run" / "step_1" / "f").write_bytes(b"mine")
    (tmp_path / "Z" / "tier" / "run").mkdir(parents=True)
    (tmp_path / "Z" / "tier" / "run" / "step_1").symlink_to(victim)
    (tmp_path / "lk").mkdir()
    (tmp_path / "lk" / "cur").symlink_to(tmp_path / "A")
    tier = PosixTier(str(tmp_path / "lk" / "cur" / "tier"))
    assert tier.get_bytes("run/step_1/f") == b"mine"
    (tmp_path / "lk" / "cur").unlink()
    (tmp_path / "lk" / "cur").symlink_to(tmp_path / "Z")
    _refuses_read_write_delete(tier, "run/step_1/f", "run/step_1/g")
    assert sorted(p.name for p in victim.iterdir()) == ["f"] and (victim / "f").read_bytes() == b"VICTIM"


def test_link_free_below_tells_present_missing_and_linked(tmp_path: Path, mode: str) -> None:
    if mode == "walk":
        assert paths.link_free_below(str(tmp_path), "a") is None  # no openat2: the caller walks
        return
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x")
    (tmp_path / "a" / "l").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "a" / "b" / "lf").symlink_to(tmp_path / "a" / "b" / "f")
    (tmp_path / "a" / "b" / "dangling").symlink_to(tmp_path / "nowhere")
    below = paths.link_free_below
    assert below(str(tmp_path), "a/b/f") == 0
    assert below(str(tmp_path), "a/b/new") == errno.ENOENT  # a new object in a directory that is there
    assert below(str(tmp_path), "a/nope/f") not in (0, errno.ENOENT)  # its directory missing: walk
    assert below(str(tmp_path), "a/l/f") not in (0, errno.ENOENT)
    assert below(str(tmp_path), "a/l/new") not in (0, errno.ENOENT)
    assert below(str(tmp_path), "a/b/lf") not in (0, errno.ENOENT)  # the last component too
    assert below(str(tmp_path), "a/b/dangling") not in (0, errno.ENOENT)
    assert below(str(tmp_path / "missing-root"), "a") is None  # the walk decides


def test_the_one_syscall_check_and_the_walk_agree_on_every_link_placement(tmp_path: Path, mode: str) -> None:
    """Keys 3 components deep under a root that is itself a link, with a link (to a directory or to a file)
    or nothing at each depth, the object present or not: the tier accepts exactly the keys with no link below
    the root, in either mode."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "f").write_bytes(b"t")
    (tmp_path / "root").symlink_to(real)
    tier = PosixTier(str(tmp_path / "root"))
    checked = 0
    for n, (link_at, present) in enumerate(itertools.product([None, 0, 1, 2], [True, False])):
        parts = [f"a{n}", "b", "c"]
        d = real
        for i, part in enumerate(parts):
            p = d / part
            if i == link_at:
                p.symlink_to(tmp_path / "target" / ("f" if i == 2 else ""))
                break
            if i < 2:
                p.mkdir()
            elif present:
                p.write_bytes(b"x")
            d = p
        key = "/".join(parts)
        if link_at is None:
            assert tier._path(key) == str(tmp_path / "root" / key)
        else:
            with pytest.raises(UnsafePathError, match="symbolic link"):
                tier._path(key)
        checked += 1
    assert checked == 8


# ----------------------------------------------------------------------------------------------------------
# A directory swapped for a link between the check and the operation (the interleavings forced here; an
# attacker who can write in the tier wins them with inotify): the operation works below descriptors reached
# without links, so it refuses, and nothing outside the tier is touched.

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "step_5").mkdir(parents=True)
    for i in range(3):
        (victim / "step_5" / f"f{i}").write_bytes(b"VICTIM")
    return victim


def _swap_for_link(d: Path, target: Path) -> None:
    d.rename(d.with_name(d.name + ".moved"))
    d.symlink_to(target)


def _untouched(victim: Path) -> bool:
    return sorted(p.name for p in (victim / "step_5").iterdir()) == ["f0", "f1", "f2"]


def test_a_run_directory_swapped_after_the_check_is_not_deleted_through(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    victim = _victim(tmp_path)
    tier = PosixTier(str(tmp_path / "root"))
    for i in range(3):
        tier.put_bytes(f"run/step_5/f{i}", b"mine")
    checked = PosixTier._path

    def check_then_swap(self: PosixTier, key: str) -> str:
        path = checked(self, key)
        if key in ("run/step_5", "run/step_5/f2"):  # after the last check of each call below
            _swap_for_link(tmp_path / "root" / "run", victim)
        return path

    monkeypatch.setattr(PosixTier, "_path", check_then_swap)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        tier.delete_prefix("run/step_5")
    assert _untouched(victim)
    (tmp_path / "root" / "run").unlink()
    (tmp_path / "root" / "run.moved").rename(tmp_path / "root" / "run")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        tier.delete([f"run/step_5/f{i}" for i in range(3)])
    assert _untouched(victim)


def test_a_directory_swapped_while_a_tree_is_removed_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``delete_prefix`` lists a directory, then a subdirectory it listed is a link to the victim when it is
    opened: refused, and the victim keeps every file."""
    from resilient_slurm.storage import posix

    victim = _victim(tmp_path)
    tier = PosixTier(str(tmp_path / "root"))
    tier.put_bytes("run/step_9/a", b"x")
    tier.put_bytes("run/step_9/sub/b", b"y")
    real_scandir = posix.os.scandir

    class SwappingScandir:
        def __init__(self, fd: int) -> None:
            self.it = real_scandir(fd)

        def __enter__(self) -> SwappingScandir:
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self):  # type: ignore[no-untyped-def]
            entries = list(self.it)
            sub = tmp_path / "root" / "run" / "step_9" / "sub"
            if any(e.name == "sub" for e in entries) and not sub.is_symlink():
                _swap_for_link(sub, victim / "step_5")
            return iter(entries)

    monkeypatch.setattr(posix.os, "scandir", SwappingScandir)
    with pytest.raises(UnsafePathError, match="not a real directory"):
        tier.delete_prefix("run/step_9")
    assert _untouched(victim)


def test_a_link_in_a_temp_files_place_is_not_written_through(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_slurm.storage import posix
    from resilient_slurm.storage.fileio import checksum

    outside = tmp_path / "outside"
    outside.write_bytes(b"OUTSIDE")
    src = tmp_path / "shard"
    src.write_bytes(b"s" * 10_000)
    tier = PosixTier(str(tmp_path / "root"))
    real_write = posix.write_file

    def write_then_swap(tmp: str, *args: object, **kw: object) -> object:
        out = real_write(tmp, *args, **kw)
        os.unlink(tmp)
        os.symlink(outside, tmp)
        return out

    monkeypatch.setattr(posix, "write_file", write_then_swap)
    with pytest.raises(UnsafePathError, match="temp file"):
        tier.put_file(str(src), "run/step_1/shard", size=10_000, checksum=checksum(src.read_bytes()))
    assert outside.read_bytes() == b"OUTSIDE" and not os.listxattr(outside)


def test_temp_names_that_are_links_are_not_transfers_and_keys_with_nul_are_refused(tmp_path: Path) -> None:
    tier = PosixTier(str(tmp_path / "root"))
    tier.put_bytes("run/step_1/f", b"x")
    (tmp_path / "big").write_bytes(b"b" * 4096)
    (tmp_path / "root" / "run" / "step_1" / "g.tmp-rslurm-0").symlink_to(tmp_path / "big")
    assert list(tier.list_incomplete("run")) == []
    assert [o.key for o in tier.list("run")] == ["run/step_1/f"]
    for bad in ("run/step_1/f\0/../../x", "run\0"):
        with pytest.raises(StorageError, match="NUL"):
            tier.get_bytes(bad)
