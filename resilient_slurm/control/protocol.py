"""Control-socket protocol, version 1: where the socket lives, how frames look, what each message means.

This module is the contract between the per-node :class:`~resilient_slurm.control.server.ControlServer`
(run by the launcher), the ranks and any tool that talks to it. It imports only the standard library,
so ranks and the launcher can load it without torch.

Location and permissions
    One Unix stream socket per job per node: ``<runtime dir>/<job id>.<node>.sock``
    (:func:`default_socket_path`). The runtime directory is ``$XDG_RUNTIME_DIR/rslurm`` when that
    directory exists and belongs to the caller, else ``/tmp/rslurm-<uid>/run``; the server creates it
    mode 0700 and the socket file mode 0600, and it accepts only peers of its own uid (SO_PEERCRED).

Frames
    A 4-byte big-endian unsigned length ``N``, then ``N`` bytes of UTF-8 JSON holding one object.
    ``1 <= N <= MAX_MESSAGE_BYTES``. The length is checked before any body byte is read: an oversized
    length gets a ``too_large`` error and the connection is closed (its framing is lost). JSON only,
    never pickle; NaN and Infinity are refused.

Messages
    Every message is ``{"v": 1, "type": <str>, "id": <int|str>, ...fields}``. The sender of a request
    picks ``id`` (an int, or a string of at most 128 characters); the reply carries the same ``id``.
    On one connection, requests are answered one by one, in order; a client may keep the connection
    for many requests. Receivers ignore fields they do not know, so fields may be added within a
    version; changing or removing one needs a new version. Every request is idempotent, so a client
    may resend one after a lost connection (:class:`~resilient_slurm.control.client.ControlClient`
    does, once); new request types must keep that property.

Requests (version 1), in the order a job uses them
    ============  =====================  ==========================================  ====================
    type          sent by, when          fields                                      reply
    ============  =====================  ==========================================  ====================
    hello         each rank, once after  rank, local_rank, pid, step (last step      ``ok`` (or an
                  start; again after a   completed, 0 if none)                       ``unknown_rank``
                  ``not_registered``                                                 error, below)
    poll          each rank, at step     rank, step (optional: last step completed)  ``state``
                  boundaries
    committed     each rank, after its   rank, step, reason ("interval" |            ``ok``
                  part of a step is      "emergency" | "final" | "manual")
                  committed
    request_save  the launcher (or a     reason ("emergency" | "manual"),            ``ok``
                  tool), on a trapped    deadline (epoch seconds by which the save
                  signal or on demand    must be committed)
    status        the launcher or a      (none)                                      ``status``
                  tool, whenever
    ping          anyone, to check that  (none)                                      ``pong``
                  the server is alive
    ============  =====================  ==========================================  ====================

Replies
    ``ok``      the request was applied.
    ``pong``    answer to ``ping``.
    ``state``   ``save_requested`` (bool), ``reason`` and ``deadline`` (null when no save is requested).
    ``status``  ``ranks`` (rank as a string -> rank, local_rank, pid, peer_pid, step, committed_step,
                registered_at, last_seen), ``last_committed`` (null, or step, reason, ranks_reported,
                complete: every registered rank reported it), ``save_requested`` (bool) and
                ``save_request`` (null, or reason, deadline, requested_at).
    ``error``   ``code`` (one of :class:`ErrorCode`) and ``message`` (what was wrong, for a human);
                ``unsupported_version`` errors also carry ``supported`` (list of versions). The id is
                null when the request's id could not be read. Error replies keep this shape in every
                version, so any peer can read them.

Refused hellos: the launcher tells its server the world size of the ranks it starts, where it knows it
(:meth:`~resilient_slurm.control.server.ControlState.expect_ranks`: ``rslurm launch -n N``). A ``hello``
whose rank is outside it gets an ``unknown_rank`` error and is not registered: no save request ever waits
for that rank. Under srun the world size is the step's, and only the uid check applies.

Save requests: a second ``request_save`` while one is pending merges into it (``emergency`` wins over
``manual``; the earlier deadline wins). The server clears the request once every registered rank has
reported ``committed`` for one step with the requested reason, after the request was made.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..errors import ControlProtocolError, ControlSetupError
from ..paths import MAX_STEP

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = (1,)
MAX_MESSAGE_BYTES: Final = 1 << 20  # far above any real message; bounds what a bad peer makes us buffer
HEADER: Final = struct.Struct(">I")
MAX_ID_CHARS: Final = 128
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES: Final = 107

# Request types.
HELLO: Final = "hello"
POLL: Final = "poll"
COMMITTED: Final = "committed"
REQUEST_SAVE: Final = "request_save"
STATUS: Final = "status"
PING: Final = "ping"
# Reply types (``status`` is both a request and its reply).
OK: Final = "ok"
STATE: Final = "state"
PONG: Final = "pong"
ERROR: Final = "error"

REQUEST_TYPES: Final = (HELLO, POLL, COMMITTED, REQUEST_SAVE, STATUS, PING)
REPLY_TYPES: Final = (OK, STATE, STATUS, PONG, ERROR)

SAVE_REASONS: Final = ("emergency", "manual")
COMMIT_REASONS: Final = ("interval", "emergency", "final", "manual")


class ErrorCode:
    """Codes of ``error`` replies; the connection stays usable unless the code says it is closed."""

    TOO_LARGE: Final = "too_large"  # length prefix above the maximum; connection closed
    BAD_LENGTH: Final = "bad_length"  # zero-length frame
    BAD_ENCODING: Final = "bad_encoding"  # body is not UTF-8 (a pickle lands here)
    BAD_JSON: Final = "bad_json"  # body is not valid JSON (or uses NaN/Infinity, or nests too deep)
    NOT_OBJECT: Final = "not_object"  # valid JSON, but not an object
    UNSUPPORTED_VERSION: Final = "unsupported_version"  # "v" missing or not supported; see "supported"
    MISSING_TYPE: Final = "missing_type"  # no "type", or not a string
    UNKNOWN_TYPE: Final = "unknown_type"  # not a request type of this version
    BAD_FIELD: Final = "bad_field"  # "id" or a field of the type is missing or has a wrong type/value
    NOT_REGISTERED: Final = "not_registered"  # poll/committed from a rank that has not sent hello
    UNKNOWN_RANK: Final = "unknown_rank"  # hello refused: a rank outside the job's world size
    PERMISSION_DENIED: Final = "permission_denied"  # peer runs as another uid; connection closed
    BUSY: Final = "busy"  # too many connections; connection closed, retry later
    INTERNAL: Final = "internal"  # a bug in the server; the request may not have been applied


@dataclass(frozen=True)
class FieldSpec:
    """How one field of a request is validated."""

    kind: str  # "int" (no bools), "number" (finite int or float) or "choice" (one of ``choices``)
    required: bool = True
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    maximum: float | None = None


_RANK = FieldSpec("int", minimum=0, maximum=2**31 - 1)
_STEP = FieldSpec("int", minimum=0, maximum=MAX_STEP)  # a step's directory has twelve digits

REQUEST_FIELDS: Final[Mapping[str, Mapping[str, FieldSpec]]] = {
    HELLO: {"rank": _RANK, "local_rank": _RANK, "pid": FieldSpec("int", minimum=1), "step": _STEP},
    POLL: {"rank": _RANK, "step": FieldSpec("int", required=False, minimum=0, maximum=MAX_STEP)},
    COMMITTED: {"rank": _RANK, "step": _STEP, "reason": FieldSpec("choice", choices=COMMIT_REASONS)},
    REQUEST_SAVE: {"reason": FieldSpec("choice", choices=SAVE_REASONS),
                   # epoch seconds: 1e11 is the year 5138 (a deadline of 1e308 was taken and logged as such)
                   "deadline": FieldSpec("number", minimum=0, maximum=1e11)},
    STATUS: {},
    PING: {},
}

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def default_runtime_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """``$XDG_RUNTIME_DIR/rslurm`` if that directory exists and is the caller's, else ``/tmp/rslurm-<uid>/run``."""
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    xdg = env.get("XDG_RUNTIME_DIR", "")
    # srun copies the submitting shell's environment, so XDG_RUNTIME_DIR often names the login node's
    # /run/user/<uid>, which does not exist on compute nodes (no login session there).
    if os.path.isabs(xdg):
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            return os.path.join(xdg, "rslurm")
    return f"/tmp/rslurm-{uid}/run"


def default_socket_path(job_id: str | int, node: str, *, runtime_dir: str | None = None,
                        env: Mapping[str, str] | None = None) -> str:
    """Socket path of job ``job_id`` on ``node``: ``<runtime dir>/<job id>.<node>.sock``."""
    for what, value in (("job id", str(job_id)), ("node name", node)):
        if not _NAME_RE.fullmatch(value):
            raise ControlSetupError(
                f"cannot name a control socket after {what} {value!r}: use 1-64 characters from "
                "letters, digits, '.', '_' and '-', starting with a letter or digit"
            )
    path = os.path.join(runtime_dir or default_runtime_dir(env), f"{job_id}.{node}.sock")
    check_socket_path(path)
    return path


def check_socket_path(path: str) -> None:
    """Raise :class:`ControlSetupError` if ``path`` cannot name a Unix socket (empty, relative or too long)."""
    if not path or not os.path.isabs(path):
        raise ControlSetupError(f"control socket path {path!r} must be an absolute path")
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise ControlSetupError(
            f"control socket path {path} is {size} bytes; Unix sockets allow at most "
            f"{MAX_SOCKET_PATH_BYTES}: choose a shorter runtime directory"
        )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode(msg: Mapping[str, Any], *, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """One frame (length prefix and JSON body) holding ``msg``; refuses bodies above ``max_bytes``."""
    try:
        # ensure_ascii: a lone surrogate (valid in a JSON string, echoed in an id) still encodes.
        body = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as exc:
        raise ControlProtocolError(f"cannot encode {msg.get('type')!r} message as JSON: {exc}",
                                   code=ErrorCode.BAD_FIELD, request_id=msg.get("id")) from exc
    if len(body) > max_bytes:
        raise ControlProtocolError(f"{msg.get('type')!r} message is {len(body)} bytes; the maximum is "
                                   f"{max_bytes}", code=ErrorCode.TOO_LARGE, request_id=msg.get("id"))
    return HEADER.pack(len(body)) + body


def body_length(header: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Body length announced by a 4-byte header; raises before any body byte is read if it is 0 or too big."""
    n: int = HEADER.unpack(header)[0]
    if n > max_bytes:
        raise ControlProtocolError(f"frame length {n} exceeds the maximum of {max_bytes} bytes; "
                                   "closing the connection", code=ErrorCode.TOO_LARGE)
    if n == 0:
        raise ControlProtocolError("zero-length frame: a frame holds one JSON object",
                                   code=ErrorCode.BAD_LENGTH)
    return n


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_body(body: bytes) -> dict[str, Any]:
    """The JSON object in a frame body; raises :class:`ControlProtocolError` naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ControlProtocolError(f"frame body is not UTF-8 ({exc.reason} at byte {exc.start}); messages "
                                   "are UTF-8 JSON, never pickle", code=ErrorCode.BAD_ENCODING) from exc
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ControlProtocolError("frame body is not valid JSON: nested too deeply",
                                   code=ErrorCode.BAD_JSON) from exc
    except ValueError as exc:
        raise ControlProtocolError(f"frame body is not valid JSON: {exc}", code=ErrorCode.BAD_JSON) from exc
    if not isinstance(obj, dict):
        raise ControlProtocolError(f"message must be a JSON object, got {type(obj).__name__}",
                                   code=ErrorCode.NOT_OBJECT)
    return obj


def _valid_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and len(value) <= MAX_ID_CHARS)


def _check_version(obj: Mapping[str, Any], request_id: Any) -> None:
    v = obj.get("v")
    if isinstance(v, bool) or not isinstance(v, int) or v not in SUPPORTED_VERSIONS:
        what = "has no \"v\" field" if "v" not in obj else f"has version {_short(v)}"
        raise ControlProtocolError(
            f"unsupported version: message {what}; supported versions: {list(SUPPORTED_VERSIONS)}",
            code=ErrorCode.UNSUPPORTED_VERSION, request_id=request_id)


def validate_fields(msg_type: str, obj: Mapping[str, Any], request_id: Any = None) -> None:
    """Check the fields of a ``msg_type`` request against :data:`REQUEST_FIELDS`."""
    for name, spec in REQUEST_FIELDS[msg_type].items():
        value = obj.get(name)
        if value is None:
            if spec.required:
                raise ControlProtocolError(f"{msg_type!r} message is missing field {name!r}",
                                           code=ErrorCode.BAD_FIELD, request_id=request_id)
            continue
        problem = None
        if spec.kind == "choice":
            if value not in spec.choices:
                problem = f"must be one of {list(spec.choices)}"
        elif isinstance(value, bool) or not isinstance(value, (int, float) if spec.kind == "number" else int):
            problem = "must be an integer" if spec.kind == "int" else "must be a number"
        elif isinstance(value, float) and not math.isfinite(value):
            problem = "must be finite"
        elif spec.minimum is not None and value < spec.minimum:
            problem = f"must be >= {spec.minimum:g}"
        elif spec.maximum is not None and value > spec.maximum:
            most = f"{int(spec.maximum)}" if spec.kind == "int" else f"{spec.maximum:g}"
            problem = f"must be <= {most}" + (" (epoch seconds)" if name == "deadline" else "")
        if problem:
            raise ControlProtocolError(f"{msg_type!r} message field {name!r} = {_short(value)} {problem}",
                                       code=ErrorCode.BAD_FIELD, request_id=request_id)


def parse_request(body: bytes) -> dict[str, Any]:
    """Decode and validate a request body: encoding, JSON, object, version, type, id, then fields."""
    obj = decode_body(body)
    rid = obj.get("id") if _valid_id(obj.get("id")) else None
    _check_version(obj, rid)
    msg_type = obj.get("type")
    if not isinstance(msg_type, str):
        what = "has no \"type\" field" if msg_type is None else f"has a non-string type {_short(msg_type)}"
        raise ControlProtocolError(f"message {what}; requests: {list(REQUEST_TYPES)}",
                                   code=ErrorCode.MISSING_TYPE, request_id=rid)
    if msg_type not in REQUEST_FIELDS:
        kind = "a reply type, not a request" if msg_type in REPLY_TYPES else "not a known message type"
        raise ControlProtocolError(f"{_short(msg_type)} is {kind}; requests: {list(REQUEST_TYPES)}",
                                   code=ErrorCode.UNKNOWN_TYPE, request_id=rid)
    if rid is None:
        raise ControlProtocolError(f"{msg_type!r} message needs an \"id\": an integer or a string of at most "
                                   f"{MAX_ID_CHARS} characters, got {_short(obj.get('id'))}",
                                   code=ErrorCode.BAD_FIELD)
    validate_fields(msg_type, obj, rid)
    return obj


def parse_reply(body: bytes, *, expected_id: Any) -> dict[str, Any]:
    """Decode a reply body and check that it answers the request ``expected_id``."""
    obj = decode_body(body)
    if obj.get("v") not in SUPPORTED_VERSIONS or obj.get("type") not in REPLY_TYPES:
        raise ControlProtocolError(f"not a version {PROTOCOL_VERSION} reply: v={_short(obj.get('v'))}, "
                                   f"type={_short(obj.get('type'))}", code=ErrorCode.UNKNOWN_TYPE)
    # Errors about unreadable frames carry no id; one request is outstanding, so they answer it.
    if obj.get("id") != expected_id and not (obj["type"] == ERROR and obj.get("id") is None):
        raise ControlProtocolError(f"reply id {_short(obj.get('id'))} does not match request id "
                                   f"{_short(expected_id)}", code=ErrorCode.BAD_FIELD)
    return obj


def make_reply(msg_type: str, request_id: Any, **fields: Any) -> dict[str, Any]:
    """A reply message of ``msg_type`` answering ``request_id``."""
    return {"v": PROTOCOL_VERSION, "type": msg_type, "id": request_id, **fields}


def make_error(exc: ControlProtocolError) -> dict[str, Any]:
    """The ``error`` reply for ``exc``."""
    extra: dict[str, Any] = {}
    if exc.code == ErrorCode.UNSUPPORTED_VERSION:
        extra["supported"] = list(SUPPORTED_VERSIONS)
    return make_reply(ERROR, exc.request_id, code=exc.code, message=str(exc), **extra)
