"""The POSIX tier never reads, writes or deletes through a symbolic link below its root: a link at any
component, the last one included, is refused; the root itself may be a link, and when that link is pointed
elsewhere after the tier was made, the check and the operation both follow it (an earlier one-syscall check
resolved the root once, at construction, and an attack read, wrote and deleted outside the tier that way).

Every test runs twice: with the check in one ``openat2`` beneath a descriptor of the root opened at each
call (``paths.link_free_below``, issue 29 item 5), and with the per-component walk it falls back to."""

from __future__ import annotations

import errno
import itertools
from pathlib import Path

import pytest

from resilient_slurm import paths
from resilient_slurm.errors import UnsafePathError
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
