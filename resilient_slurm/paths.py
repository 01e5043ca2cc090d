"""Where a run's files live: node name, node-local root, run id. Standard library only, so the launcher
and the CLI can name a run's directory without importing torch.

It also holds the one guard of every input the product accepts (docs/architecture.md, "Inputs and their
guards"):

* identifiers: :func:`id_problem` / :func:`check_id` is the one validation of run ids, tags, node names
  and step numbers, called by every entry point (settings, the CLI's arguments, the daemon, the
  launcher, the Checkpointer) before anything is written;
* files: :func:`open_regular` (with ``root``: no symbolic link at any component below the root, walked
  with ``openat``), :func:`read_regular` (regular file only, opened non-blocking, a size cap) and
  :func:`load_json` (no NaN/Infinity, bounded nesting, finite numbers); writers use
  :func:`resilient_slurm.storage.fileio.atomic_write` with the same ``root``;
* the private directories: :func:`ensure_private_dir` (the default local directory
  ``$TMPDIR/rslurm-<uid>``, the control socket's runtime directory, the local root's ``.rslurm/``) and
  :func:`open_state_file`."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError
from .jobenv import JobEnv

# The local root's private state directory: the daemon's lock and status, the runs' writer locks.
STATE_DIR = ".rslurm"

# How to leave the default local directory behind; every refusal of it says so.
LOCAL_DIR_ELSEWHERE = "set RSLURM_LOCAL_DIR (or --local-dir) to a directory of your own"


def node_name(explicit: str | None = None) -> str:
    """This process's node name: explicit > $SLURMD_NODENAME > hostname; checked like every identifier
    (:func:`check_id`): it names a directory (``%n``) and a storage domain."""
    return check_id("node name", explicit or JobEnv.from_env().node_name or socket.gethostname())


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
    """Slurm job id (``<array job>_<task>`` for array tasks); ``default`` outside Slurm. Checked like an
    explicit run id (:func:`check_id`): a job id no run directory can be named after is a ConfigError."""
    return check_id("run id", JobEnv.from_env(env).run_key() or "default")


# --------------------------------------------------------------------------- identifiers (one validation)
MAX_STEP = 10**12 - 1  # step_<step:012d>: twelve digits
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# kind -> longest name. Run ids and node names become directory names and durable keys; tags live in a
# small JSON file and stand where a STEP is expected.
_NAME_LENGTH = {"run id": 128, "tag": 64, "node name": 255}
ID_KINDS = (*_NAME_LENGTH, "step")


def id_problem(kind: str, value: object) -> str | None:
    """Why ``value`` cannot be a ``kind`` (``run id``, ``tag``, ``node name``, ``step``); None when it can.

    The one validation of identifiers, called at every entry point before anything is written. A name is
    1 to N letters, digits, ``.``, ``_`` and ``-`` starting with a letter or digit (so never ``.``,
    ``..``, a path, empty, or holding a control character); a tag is also not only digits (it would read
    as a step). A step is an integer (or ASCII digits) from 0 to :data:`MAX_STEP`."""
    if kind == "step":
        if isinstance(value, str):
            if (not value or not value.isascii() or not value.isdigit()
                    or len(value.lstrip("0")) > len(str(MAX_STEP))):
                return f"a step is a number from 0 to {MAX_STEP}, got {value[:40]!r}"
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_STEP:
            return f"a step is a number from 0 to {MAX_STEP}, got {str(value)[:40]!r}"
        return None
    longest = _NAME_LENGTH[kind]
    if not isinstance(value, str):
        return f"a {kind} is a string, got {type(value).__name__}"
    if not value or len(value) > longest:
        return f"a {kind} has 1 to {longest} characters, {value[:80]!r} has {len(value)}"
    if not _NAME_RE.fullmatch(value):
        return (f"{value[:80]!r}: a {kind} holds letters, digits, '.', '_' and '-' only, and starts with a letter or "
                "a digit")
    if kind == "tag" and value.isdigit():
        return f"{value!r}: a tag cannot be only digits (it would read as a step number)"
    return None


def check_id(kind: str, value: Any, *, error: Callable[[str], Exception] = ConfigError) -> Any:
    """``value`` (a step given as text: its number) if it can be a ``kind``, else ``error`` saying why."""
    problem = id_problem(kind, value)
    if problem is not None:
        raise error(f"invalid {kind}: {problem}")
    return int(value) if kind == "step" else value


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


def describe_path(path: str) -> str:
    """What ``path`` is now, in words, without following it: ``a FIFO (named pipe)``, ``a symlink (to '/x')``."""
    return _describe(path)


def is_special(path: str) -> bool:
    """Whether ``path`` is there and is neither a regular file, a directory nor a link: a device, a FIFO, a
    socket (not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


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
                 shown: str | None = None, error: Callable[[str], Exception] = ConfigError,
                 where: str = "its local directory", root: str | None = None, make_dirs: bool = False) -> int:
    """``os.open(path, flags, mode)`` for a file in a directory others might have planted things in:
    never follows a symlink as the last component (O_NOFOLLOW), never blocks on a FIFO (O_NONBLOCK while
    opening, cleared after), and accepts only a regular file (fstat). Anything else is refused with
    ``error`` (ConfigError unless given) naming the path (``shown``, else ``path``), what is there and
    ``where`` it is; other failures raise OSError as ``os.open`` does. Every open of a file rslurm did
    not just create itself, in the local directory or a POSIX durable tier, goes through here (the
    checkpoint readers through :func:`resilient_slurm.storage.fileio.open_regular`).

    ``root``: ``path`` lies below it (a local root: the run directory, ``metrics/``, a step directory...
    and the file itself), and no component below ``root`` may be a symbolic link or anything but a
    directory: each is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before
    (:func:`open_parent`), so nothing can be swapped in between. ``make_dirs``: create missing
    directories below ``root`` (mode 0700), and ``root`` itself."""
    if root is not None:
        pfd, name = open_parent(root, path, error=error, where=where, make_dirs=make_dirs)
        try:
            return open_regular(name, flags, mode, dir_fd=pfd, shown=shown or path, error=error, where=where)
        finally:
            os.close(pfd)
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


def below(root: str, path: str) -> list[str] | None:
    """The components of ``path`` below ``root`` (both made absolute and normalized), or None when
    ``path`` is not strictly below ``root``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    parts = rel.split(os.sep)
    if rel == "." or parts[0] == ".." or any(p in ("", ".", "..") for p in parts):
        return None
    return parts


def nearest_existing(path: str) -> str:
    """``path`` when something (a link too) is there, else the nearest path above it that exists: what stands
    where a directory ``path`` would be made (a file there is named in the error)."""
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def open_parent(root: str, path: str, *, error: Callable[[str], Exception] = ConfigError,
                where: str = "its local directory", make_dirs: bool = False) -> tuple[int, str]:
    """A descriptor of the directory holding ``path`` and the file's name in it, reached from ``root``
    one component at a time with ``O_NOFOLLOW | O_DIRECTORY``: a symbolic link, a file or a special file
    at any component below ``root`` is refused with ``error`` naming that component and what it is
    (``root`` itself may be a link: it is the user's choice). ``make_dirs`` creates missing directories
    (mode 0700; ``root`` too). FileNotFoundError when one is missing otherwise. The caller closes the
    descriptor."""
    parts = below(root, path)
    if parts is None:
        raise error(f"{path} is not inside {root}; rslurm keeps {where} below its root")
    root = os.path.abspath(root)
    if make_dirs:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            pass  # a file where the root or one of its parents goes: named below
    try:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        blocker = nearest_existing(root)
        raise error(f"{root} cannot be a directory: {blocker} is {_describe(blocker)}, not a directory; {where} "
                    "goes there: set it to a directory") from None
    cur = root
    try:
        for part in parts[:-1]:
            cur = os.path.join(cur, part)
            try:
                nfd = _open_dir(part, dfd)
            except FileNotFoundError:
                if not make_dirs:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=dfd)
                except FileExistsError:
                    pass
                nfd = _open_dir(part, dfd)
            except NotADirectoryError:
                raise error(f"{cur} is {_describe(part, dfd)}, not a real directory; rslurm never follows a "
                            f"symlink (or opens anything but a directory) below {root}, where {where} is: "
                            "remove it (and find out who made it)") from None
            os.close(dfd)
            dfd = nfd
    except BaseException:
        os.close(dfd)
        raise
    return dfd, parts[-1]


# openat2(2) (Linux 5.6+): the syscall number is 437 on every architecture (the generic table).
# RESOLVE_NO_SYMLINKS: a symbolic link at any component of the path, the last one included, is refused
# (ELOOP); RESOLVE_BENEATH: the path may not leave the directory it is resolved from.
_SYS_OPENAT2 = 437
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_openat2_state: list[Any] = []  # [callable or None], filled on first use


def _openat2() -> Callable[[int, str], int] | None:
    """``openat2(dir_fd, rel, O_PATH, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` as ``(dir_fd, rel) -> 0 or
    errno`` (the descriptor closed at once), or None where the kernel has no usable openat2."""
    if not _openat2_state:
        _openat2_state.append(_make_openat2())
    return _openat2_state[0]  # type: ignore[no-any-return]


def _make_openat2() -> Callable[[int, str], int] | None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)

        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

        how = OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        size = ctypes.sizeof(how)

        def call(dir_fd: int, rel: str) -> int:
            fd = libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), size)
            if fd < 0:
                return ctypes.get_errno() or errno.EIO
            os.close(fd)
            return 0

        # ENOSYS (an older kernel), EPERM (a seccomp filter): not usable here. Probed beneath "/", which
        # every process can open (its working directory may have been deleted).
        rfd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            usable = call(rfd, ".") == 0
        finally:
            os.close(rfd)
        return call if usable else None
    except (OSError, AttributeError, ImportError):
        return None


def link_free_below(root: str, rel: str) -> int | None:
    """Whether ``rel`` exists below the directory ``root`` with no symbolic link at any of its components,
    in one ``openat2`` where the kernel allows. ``root`` itself may be a link: it is opened (``O_PATH``) at
    this call, as it is now, and ``rel`` is resolved beneath that descriptor (``RESOLVE_BENEATH |
    RESOLVE_NO_SYMLINKS``), so a root pointed elsewhere since the last call is checked where it points now.

    0: ``rel`` exists and none of its components is a link. ``errno.ENOENT`` when ``rel`` is missing but its
    directory exists link-free (a new object in an existing directory). Any other errno (a link: ELOOP or
    EXDEV; a missing directory): the caller walks the components to tell which. None: this kernel cannot
    answer (before Linux 5.6, or a seccomp filter), or the root cannot be opened; the caller walks."""
    fn = _openat2()
    if fn is None:
        return None
    try:
        rfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None  # the root missing or not a directory: the walk says what the caller needs
    try:
        found = fn(rfd, rel)
        if found == errno.ENOENT and "/" in rel and fn(rfd, os.path.dirname(rel)) != 0:
            return errno.ENOTDIR  # not only the object is missing: the walk finds what is
        return found
    finally:
        os.close(rfd)


def _open_dir(name: str, dir_fd: int) -> int:
    """``name`` in ``dir_fd`` opened as a directory, never through a link (NotADirectoryError for a
    link or anything else that is not a directory)."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(exc.errno, exc.strerror, name) from None
        raise


def read_regular(path: str, max_bytes: int, *, root: str | None = None, follow: bool = False,
                 error: Callable[[str], Exception] = ConfigError, where: str = "its local directory",
                 what: str = "this file") -> bytes:
    """The bytes of a file read defensively: a regular file only (opened non-blocking and checked with
    ``fstat`` before a byte is read: never a FIFO, a socket or ``/dev/zero``), never more than
    ``max_bytes`` (``error`` naming the file and ``what`` it is), never through a link at any component
    below ``root`` (:func:`open_regular`). ``follow``: the file is one the user named (a config file),
    whose links are followed. FileNotFoundError when it is not there; OSError when it cannot be read."""
    if follow:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.ENODEV):
                raise
            raise error(_named_refusal(path, _describe(path), where)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise error(_named_refusal(path, _a(_kind(st)), where))
    else:
        fd = open_regular(path, os.O_RDONLY, error=error, where=where, root=root)
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise error(f"{path}: {os.fstat(fd).st_size} bytes, more than {what} may have ({max_bytes}); not read")
        chunks, left = [], max_bytes + 1
        while left > 0:
            b = os.pread(fd, min(left, 1 << 20), max_bytes + 1 - left)
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise error(f"{path}: more than {what} may have ({max_bytes} bytes); not read")
    return data


# --------------------------------------------------------------------------- JSON from disk (depth-limited)
MAX_JSON_DEPTH = 32  # every document rslurm writes is under 8 levels deep
# Times in rslurm's files (seconds since the epoch) are between 1970 and the year 9999: a time that
# cannot be printed (1e308) is not one rslurm wrote.
MAX_TIME = 253402300799.0


def valid_time(v: object) -> bool:
    """``v`` is a number of seconds since the epoch that a date can show (0 to :data:`MAX_TIME`)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and 0 <= v <= MAX_TIME)


def load_json(data: bytes | str, *, source: str, error: Callable[[str], Exception] = ConfigError,
              max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON read from disk or the wire: ``error`` naming ``source`` for text that is not JSON, NaN or
    Infinity, a number out of range (``1e999``, an integer of thousands of digits), or nesting deeper
    than ``max_depth`` (checked without recursion, so no depth crashes the reader). Duplicate keys: the
    last wins, as in :func:`json.loads`."""
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{source}: nested too deeply (more than {max_depth} levels); not a file rslurm wrote") from None
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        text = str(exc)
        raise error(f"{source}: not valid JSON ({text[:120]}); not a file rslurm wrote") from None
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > max_depth:
                raise error(f"{source}: nested too deeply (more than {max_depth} levels); not a file rslurm wrote")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, float) and not math.isfinite(v):
            raise error(f"{source}: a number out of range ({v}); not a file rslurm wrote")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number rslurm writes")


def _named_refusal(path: str, kind: str, where: str) -> str:
    """The refusal of a file the user named (``--config``, ``--script``): a device or a FIFO is not theirs to remove."""
    return f"{path} is {kind}, not a regular file: give {where} the path of a regular file"


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
