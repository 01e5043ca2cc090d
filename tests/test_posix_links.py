"""The POSIX tier never reads, writes or deletes through a symbolic link below its root: a link at any
component, the last one included, is refused; the root itself may be a link, and when that link is pointed
elsewhere after the tier was made, the check and the operation both follow it (an attack on a one-syscall
check resolved at construction read, wrote and deleted outside the tier that way: issue 29 item 5 stays
open, see docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient_slurm.errors import UnsafePathError
from resilient_slurm.storage.posix import PosixTier


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
    with pytest.raises(UnsafePathError):
        tier.get_bytes("run/step_2/f")
    with pytest.raises(UnsafePathError):
        tier.put_bytes("run/step_2/new", b"x")
    with pytest.raises(UnsafePathError):
        tier.delete(["run/step_2/f"])
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
    with pytest.raises(UnsafePathError):
        tier.get_bytes("run/step_1/f")
    with pytest.raises(UnsafePathError):
        tier.put_bytes("run/step_1/g", b"x")
    with pytest.raises(UnsafePathError):
        tier.delete(["run/step_1/f"])
    assert sorted(p.name for p in victim.iterdir()) == ["f"] and (victim / "f").read_bytes() == b"VICTIM"
