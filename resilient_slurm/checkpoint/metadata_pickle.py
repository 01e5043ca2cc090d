"""What a step's ``.metadata`` pickle may name, and a check of that without unpickling or importing torch.

DCP writes ``.metadata`` with pickle; plain ``dcp`` readers unpickle it without restriction, so a
tampered one runs code. Every reader in rslurm applies one allow-list (:data:`ALLOWED_GLOBALS`):

* restore, fetch, ``verify``, ``show`` and ``export`` unpickle with it
  (:func:`resilient_slurm.checkpoint.planning.load_metadata`, which needs torch);
* the drain daemon and ``rslurm gc``, which must not import torch, check the same list statically with
  :func:`check_metadata_bytes`: every global the pickle names (``GLOBAL``, ``INST``, ``STACK_GLOBAL``
  with its two strings tracked through the pickle's stack and memo) must be on the list; extension
  codes and persistent ids are refused. A step that fails is never drained (so never made durable for
  plain ``dcp`` readers), and never counts toward retention's ``keep_last``.
"""

from __future__ import annotations

import pickletools
import re
from typing import Any

from ..errors import CorruptCheckpointError
from ..manifest import ChunkEntry, read_regular_file
from ..storage.fileio import checksum

ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch._utils": frozenset({"_get_layout"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict"}),
}

# torch.Size and the dtypes (torch.float32, torch.float8_e4m3fn, torch.bits8, ...): attributes of the
# torch module that DCP pickles by name. Matched by pattern so a later torch's new dtype is not refused.
_TORCH_NAME = re.compile(r"Size|bool|long|short|half|chalf|float|double|cfloat|cdouble|bfloat16"
                         r"|q?u?int\d*(x\d+)?|float\d+\w*|complex\d+|bits\d+(x\d+)?|bit")


def allowed(module: str, name: str) -> bool:
    """Whether a DCP metadata pickle may name ``module.name``."""
    if module == "torch":
        return _TORCH_NAME.fullmatch(name) is not None
    return name in ALLOWED_GLOBALS.get(module, ())


_MARK = object()
_REFUSED = {"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"}


def scan(data: bytes, *, source: str) -> None:
    """Raise CorruptCheckpointError naming ``source`` unless the pickle ``data`` names only allowed
    globals. Nothing is unpickled: the pickle's opcodes are walked with a model of its stack in which
    only strings keep their value (enough to know the module and name a ``STACK_GLOBAL`` takes)."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _REFUSED:
                raise CorruptCheckpointError(f"{source}: DCP metadata uses pickle opcode {name}, which DCP never "
                                             "writes; the step is not usable")
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                _check(module, attr, source)
            elif name == "STACK_GLOBAL":
                attr, module = stack.pop(), stack.pop()
                if not (isinstance(module, str) and isinstance(attr, str)):
                    raise CorruptCheckpointError(f"{source}: DCP metadata names a global it builds at run time; "
                                                 "the step is not usable")
                _check(module, attr, source)
                stack.append(None)
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1]
                continue
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = stack[-1]  # type: ignore[arg-type]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(int(arg)))  # type: ignore[arg-type]
                continue
            # Every other opcode: pop what it consumes (to the mark, for the ones that take a slice)
            # and push placeholders, or the string it pushes.
            before = op.stack_before
            if pickletools.stackslice in before:
                while stack and stack.pop() is not _MARK:
                    pass
                before = [b for b in before if b not in (pickletools.stackslice, pickletools.markobject)]
            for _ in before:
                stack.pop()
            for after in op.stack_after:
                if after is pickletools.markobject:
                    stack.append(_MARK)
                elif isinstance(arg, str) and after in (pickletools.pyunicode, pickletools.pystring):
                    stack.append(arg)
                else:
                    stack.append(None)
    except CorruptCheckpointError:
        raise
    except (ValueError, IndexError, TypeError, KeyError) as exc:  # not a pickle, or a malformed one
        raise CorruptCheckpointError(f"{source}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from None


def _check(module: str, attr: str, source: str) -> None:
    if not allowed(module, attr):
        raise CorruptCheckpointError(f"{source}: global {module}.{attr} is not allowed in DCP metadata (a plain "
                                     "dcp reader would run it); the step is not usable")


def check_metadata_bytes(data: bytes, expected: ChunkEntry, *, source: str, scanned: bool = True) -> None:
    """The size and checksum the manifest records, then :func:`scan` (unless not ``scanned``: a caller that
    unpickles with the allow-list next, which refuses the same globals); torch is not imported."""
    if len(data) != expected.length or checksum(data) != expected.checksum:
        raise CorruptCheckpointError(f"{source}: size or checksum does not match the manifest ({len(data)} bytes "
                                     f"with xxh3 {checksum(data)}; it says {expected.length} bytes with "
                                     f"{expected.checksum})")
    if scanned:
        scan(data, source=source)


def read_checked_metadata(path: str, expected: ChunkEntry, *, scanned: bool = True) -> bytes:
    """The bytes of a local ``.metadata`` file, read as a regular file only (never through a link, never
    more bytes than the manifest records) and checked with :func:`check_metadata_bytes`: the one reader of
    a local ``.metadata`` (restore and verify unpickle what it returns; the daemon drains it; ``gc`` and
    retention judge a step valid by it). A missing file is corruption too. Raises CorruptCheckpointError
    (or OSError when the file cannot be read) naming ``path``. ``scanned=False``: restore, which unpickles
    with the allow-list right after (the static scan walks every opcode in Python: 0.2 s of a 1 GiB
    restore on a busy node, for no check the restricted unpickler does not make)."""
    try:
        data = read_regular_file(path, expected.length, what="DCP metadata")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing") from None
    check_metadata_bytes(data, expected, source=path, scanned=scanned)
    return data


__all__ = ["ALLOWED_GLOBALS", "allowed", "check_metadata_bytes", "read_checked_metadata", "scan"]
