"""Where a run's files live: node name, node-local root, run id. Standard library only, so the launcher
and the CLI can name a run's directory without importing torch.

It also holds the checks that keep other users out of those files: :func:`ensure_private_dir` (the
default local directory ``$TMPDIR/rslurm-<uid>``, the control socket's runtime directory, the local
root's ``.rslurm/``) and :func:`open_regular` / :func:`open_state_file` (files opened there never follow a
symlink and never block on a FIFO)."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import tempfile
from collections.abc import Mapping

from .errors import ConfigError
from .jobenv import JobEnv

# How to leave the default local directory behind; every refusal of it says so.
LOCAL_DIR_ELSEWHERE = "set RSLURM_LOCAL_DIR (or --local-dir) to a directory of your own"


def node_name(explicit: str | None = None) -> str:
    """This process's node name: explicit > $SLURMD_NODENAME > hostname."""
    return explicit or JobEnv.from_env().node_name or socket.gethostname()


def expand_local_dir(template: str, node: str) -> str:
    """Expand ``%n`` (node name) and ``~`` in a local_dir template."""
    return os.path.abspath(os.path.expanduser(template.replace("%n", node)))


def default_local_dir() -> str:
    """Per-user directory under $TMPDIR, one sub-directory per node: ``$TMPDIR/rslurm-<uid>/%n``.

    Resolving it secures ``$TMPDIR/rslurm-<uid>``, whose name anyone can guess and create first: it is
    made mode 0700 if missing, and otherwise must be a real directory (not a symlink) owned by this user
    that group and others cannot write, inside parents no other user can modify
    (:func:`ensure_private_dir`). Raises :class:`ConfigError` naming the directory, what is wrong and what
    to do. An explicit ``local_dir`` is the user's choice and is not checked here."""
    base = default_local_base()
    ensure_private_dir(base, what="default local directory", deny=0o022,
                       why="so that no other user can replace or plant checkpoints in it",
                       elsewhere=LOCAL_DIR_ELSEWHERE)
    return os.path.join(base, "%n")


def default_local_base() -> str:
    """``$TMPDIR/rslurm-<uid>``, the directory :func:`default_local_dir` secures, unchecked (to name it)."""
    return os.path.join(tempfile.gettempdir(), f"rslurm-{os.getuid()}")


def default_run_id(env: Mapping[str, str] | None = None) -> str:
    """Slurm job id (``<array job>_<task>`` for array tasks); ``default`` outside Slurm."""
    return JobEnv.from_env(env).run_key() or "default"


# --------------------------------------------------------------------------- private directories and files
def _kind(st: os.stat_result) -> str:
    """What a file is, in words, for an error message."""
    for test, word in ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISREG, "regular file"),
                       (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(st.st_mode):
            return word
    return "special file"


def _describe(path: str, dir_fd: int | None = None) -> str:
    """``a symlink (to '/x')``, ``a FIFO (named pipe)``...: what ``path`` is now, without following it."""
    try:
        st = os.lstat(path, dir_fd=dir_fd)
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    kind = _kind(st)
    if stat.S_ISLNK(st.st_mode):
        try:
            kind += f" (to {os.readlink(path, dir_fd=dir_fd)!r})"
        except OSError:
            pass
    return _a(kind)


def _a(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def make_missing_dirs(path: str, created: list[str] | None = None, *, exact_mode: bool = True) -> list[str]:
    """Create ``path`` and each of its missing parents, outermost first, mode 0700; return the
    directories made here, outermost first, also appended to ``created`` (when given) as each is made.

    ``exact_mode``: chmod each one 0700 after mkdir, whose mode the umask filters (as
    :func:`ensure_private_dir` does); without it the umask applies, as with ``os.makedirs(mode=0o700)``.
    A directory that appears meanwhile (FileExistsError) is skipped and not counted: whoever calls this
    checks what is there. A failed mkdir raises its OSError, whose ``filename`` is the directory that
    could not be made; ``created`` then holds those made before it. Checks nothing else: that is
    :func:`ensure_private_dir`, which calls it (and ``rslurm doctor``, for the local directory it makes
    and removes again)."""
    made = [] if created is None else created
    start = len(made)
    missing = []
    d = path
    while not os.path.lexists(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # created concurrently; the caller's checks decide whether it is usable
            continue
        made.append(d)
        if exact_mode:
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask; be exact
    return made[start:]


def ensure_private_dir(path: str, *, what: str, why: str, elsewhere: str,
                       error: type[Exception] = ConfigError, deny: int = 0o077,
                       check_parents: bool = True) -> str:
    """Create ``path`` (and missing parents) mode 0700, or check the directory that is there; return it
    (absolute).

    Refused with ``error`` (its message names ``what`` and ``path``, what is wrong and what to do:
    ``elsewhere`` says how to choose another directory) unless ``path`` is a real directory, not a
    symlink, owned by this user (effective uid), with none of the ``deny`` mode bits (0o077: private;
    0o022: not writable by group or others) and, with ``check_parents``, inside directories that only
    this user or root can modify (or sticky ones, like /tmp): otherwise another user could rename ours
    and put theirs in its place. One function for every such directory: the control socket's runtime
    directory, the default local directory ``$TMPDIR/rslurm-<uid>`` and ``<local root>/.rslurm``."""
    path = os.path.abspath(path)
    try:
        make_missing_dirs(path)
    except OSError as exc:
        raise error(f"cannot create {what} {exc.filename or path}: {exc.strerror or exc}; "
                    f"{elsewhere}") from exc
    st = os.lstat(path)
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        link = " (whoever made the symlink decides where your files go)" if stat.S_ISLNK(st.st_mode) else ""
        raise error(f"{what} {path} is {_describe(path)}, not a real directory{link}; remove it, "
                    f"or {elsewhere}")
    if st.st_uid != uid:
        raise error(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {uid}): its owner could "
                    f"read or replace everything in it; remove it (its owner or root can), or {elsewhere}")
    if st.st_mode & deny:
        need = "0700" if deny & 0o044 else "writable by you alone"
        raise error(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be {need} {why}: "
                    f"chmod 700 {path} if you made it so, else remove it (others may have put files in it); "
                    f"or {elsewhere}")
    if check_parents:
        # Someone who can write to an ancestor can rename our directory and put theirs in its place.
        d = os.path.dirname(os.path.realpath(path))
        while True:
            ast = os.stat(d)
            if ast.st_uid not in (uid, 0) or (ast.st_mode & 0o022 and not ast.st_mode & stat.S_ISVTX):
                raise error(
                    f"{what} {path} is inside {d} (owner uid {ast.st_uid}, mode "
                    f"{stat.S_IMODE(ast.st_mode):04o}), which another user could modify; {elsewhere} whose "
                    "parents are owned by you or root and not writable by others")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return path


def open_regular(path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None,
                 shown: str | None = None, error: type[Exception] = ConfigError,
                 where: str = "its local directory") -> int:
    """``os.open(path, flags, mode)`` for a file in a directory others might have planted things in:
    never follows a symlink as the last component (O_NOFOLLOW), never blocks on a FIFO (O_NONBLOCK while
    opening, cleared after), and accepts only a regular file (fstat). Anything else is refused with
    ``error`` (ConfigError unless given) naming the path (``shown``, else ``path``), what is there and
    ``where`` it is; other failures raise OSError as ``os.open`` does. Every open of a file rslurm did
    not just create itself, in the local directory or a POSIX durable tier, goes through here (the
    checkpoint readers through :func:`resilient_slurm.storage.fileio.open_regular`)."""
    shown = shown or path
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        # ELOOP: a symlink (O_NOFOLLOW); ENXIO: a FIFO without a reader, or a socket; ENODEV: a device
        # file without its device; EISDIR: a directory opened for writing.
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EISDIR):
            raise
        raise error(_refusal(shown, _describe(path, dir_fd), where)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(_refusal(shown, _a(_kind(st)), where))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refusal(path: str, kind: str, where: str = "its local directory") -> str:
    return (f"{path} is {kind}, not a regular file; rslurm does not follow symlinks or open special files "
            f"in {where}: remove it (and find out who made it)")


def open_state_file(state_dir: str, name: str, flags: int, mode: int = 0o600, *, create: bool = False) -> int:
    """Open ``name`` in a local root's state directory ``state_dir`` (``<local root>/.rslurm``: the
    daemon's lock and status) as :func:`open_regular` does.

    ``create``: make ``state_dir`` mode 0700 if missing and refuse it unless it is a real directory of this
    user's that no one else can write (:func:`ensure_private_dir`; the daemon, before it takes its lock).
    Always: a ``state_dir`` that is a symlink or not a directory is refused (it is opened with O_NOFOLLOW
    and ``name`` relative to it, so nothing can be swapped in between). Raises :class:`ConfigError` naming
    the path; a missing directory or file raises FileNotFoundError."""
    if create:
        ensure_private_dir(state_dir, what="rslurm state directory", why="so that no other user can take or "
                           "fake the daemon's lock and status", elsewhere="use another local_dir",
                           check_parents=False)
    try:
        dfd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise ConfigError(f"rslurm state directory {state_dir} is {_describe(state_dir)}, not a real "
                          "directory; rslurm does not follow a symlink there: remove it (and find out who "
                          "made it)") from None
    try:
        return open_regular(name, flags, mode, dir_fd=dfd, shown=os.path.join(state_dir, name))
    finally:
        os.close(dfd)
