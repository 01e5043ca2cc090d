"""The POSIX tier's link check in one syscall (issue 29 item 5): ``paths.link_free`` (openat2 with
RESOLVE_NO_SYMLINKS) decides the common case, the per-component walk everything else, and both refuse the
same paths: a link at any component below the root, the last one included; the root itself may be a link."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from resilient_slurm import paths
from resilient_slurm.errors import UnsafePathError
from resilient_slurm.storage.posix import PosixTier

HAVE_OPENAT2 = paths._openat2() is not None


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "openat2" and not HAVE_OPENAT2:
        pytest.skip("openat2 is not usable on this kernel (the walk is tested)")
    if request.param == "walk":
        monkeypatch.setattr(paths, "_openat2_state", [None])
    return str(request.param)


@pytest.mark.skipif(not HAVE_OPENAT2, reason="openat2 is not usable on this kernel")
def test_link_free_tells_present_missing_and_linked(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x")
    (tmp_path / "a" / "l").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "a" / "b" / "lf").symlink_to(tmp_path / "a" / "b" / "f")
    assert paths.link_free(str(tmp_path / "a" / "b" / "f")) == 0
    assert paths.link_free(str(tmp_path / "a" / "nope" / "f")) == errno.ENOENT
    assert paths.link_free(str(tmp_path / "a" / "l" / "f")) == errno.ELOOP
    assert paths.link_free(str(tmp_path / "a" / "b" / "lf")) == errno.ELOOP  # the last component too


def test_the_tier_refuses_links_below_its_root_either_way(tmp_path: Path, mode: str) -> None:
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
    assert not (outside / "step" / "new").exists()
    assert (outside / "step" / "f").read_bytes() == b"secret"


def test_a_missing_directory_below_a_link_is_still_refused(tmp_path: Path, mode: str) -> None:
    """openat2 says ENOENT for a missing name below a link too; the walk then finds the link."""
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "run").symlink_to(tmp_path / "elsewhere")
    tier = PosixTier(str(tmp_path / "root"))
    with pytest.raises(UnsafePathError, match="symbolic link"):
        tier.put_bytes("run/step_1/deep/f", b"x")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_an_unusable_openat2_falls_back_to_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "_openat2_state", [None])
    assert paths.link_free("/") is None
