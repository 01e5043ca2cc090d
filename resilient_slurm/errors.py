"""One error hierarchy for the whole package.

Every error a user can meet says what happened, to which file/step/rank, and what to do. Transient
errors (a flaky network, an S3 503) may be retried; permanent ones (corrupt data, a bad configuration)
never are.
"""

from __future__ import annotations

from typing import Any


class ResilientSlurmError(Exception):
    """Root of every error raised by resilient_slurm."""


class TransientError(ResilientSlurmError):
    """A failure that may succeed when retried (network blips, throttling, busy resources)."""


class PermanentError(ResilientSlurmError):
    """A failure that retrying cannot fix (bad input, corrupt data, misconfiguration)."""


class ConfigError(PermanentError):
    """A configuration key or value is wrong; the message names the key and the valid choices."""


class RendezvousError(ConfigError):
    """The ranks cannot meet: the rendezvous address (``MASTER_ADDR``) does not resolve, or nothing answered
    at ``MASTER_ADDR:MASTER_PORT``. The message names the address, the port, where the address came from
    and what to set. The launcher classes a rank that ends with it as a ``startup`` failure."""


class CheckpointError(PermanentError):
    """A checkpoint could not be saved or restored."""


class SaveError(CheckpointError):
    """A save failed; every previously committed step is untouched."""


class InsufficientSpaceError(SaveError):
    """The target filesystem has less free space than the save needs (checked before writing)."""


class StepOrderError(SaveError):
    """A save at or below the step the run resumed from (or the newest step committed before this
    Checkpointer started), or below a step it saved itself: it would replace steps of another run
    history. The message names both steps."""


class ReplicaMismatchError(SaveError):
    """Copies of state replicated by construction differ between ranks, and ``replica_check=fail``."""

    def __init__(self, message: str, mismatches: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.mismatches = mismatches  # replication.ReplicaMismatch entries


class CorruptCheckpointError(CheckpointError):
    """A committed step fails validation: garbage manifest, missing/truncated shard, checksum mismatch."""


class TagsFileError(CorruptCheckpointError):
    """A run's tags file (``tags.json``, local or durable) is unreadable or malformed. Until it is fixed or
    moved away, nothing deletes a step of that run (retention, eviction, ``rslurm gc``): which steps are
    tagged is unknown. The message names the file and what is wrong."""


class IncompatibleCheckpointError(CheckpointError):
    """A valid checkpoint cannot be restored into this state (unknown schema, missing key, world size)."""


class RestoreUnavailableError(TransientError):
    """Committed checkpoints exist, or may (the durable tier could not be listed), but storage failures
    kept every one from being restored; the job stops instead of starting over from step 0. ``rslurm
    launch`` requeues such a job (``restore_fallback=fresh`` starts from step 0 instead)."""


class StorageError(ResilientSlurmError):
    """A storage tier operation failed (wraps the underlying OS or client error)."""


class TransientStorageError(StorageError, TransientError):
    """A storage operation failed in a way worth retrying."""


class ObjectNotFoundError(StorageError, PermanentError):
    """A key or file asked for does not exist in the storage tier."""


class UnsafePathError(StorageError, PermanentError):
    """A path inside a tier is a symbolic link or a special file; rslurm never reads, writes or deletes
    through one (the message names it)."""


class DistributedError(CheckpointError):
    """Ranks disagreed or a collective failed while coordinating a save or restore."""


class ControlError(ResilientSlurmError):
    """The per-node control socket failed; the message names the socket path."""


class ControlSetupError(ControlError, PermanentError):
    """The control socket cannot be created: unsafe runtime directory, bad path, or path too long."""


class ControlSocketInUseError(ControlSetupError):
    """A live control server already answers at the socket path (another launcher for this job/node)."""


class ControlUnavailableError(ControlError, TransientError):
    """No control server answers at the socket path (not started yet, stopped, or the connection dropped)."""


class ControlTimeoutError(ControlUnavailableError):
    """The control server did not answer within the client's timeout."""


class ControlProtocolError(ControlError, PermanentError):
    """A frame or message breaks the control protocol; ``code`` names the rule that was broken."""

    def __init__(self, message: str, *, code: str, request_id: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class ControlRejectedError(ControlError, PermanentError):
    """The control server answered a request with an error reply; ``code`` is that reply's code."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


class SlurmError(ResilientSlurmError):
    """A Slurm command (scontrol, scancel, sbatch) failed.

    The message names the command, its exit code and stderr; the same facts are attributes so callers can
    decide without parsing text. ``attempts`` is how many times the command ran before giving up.
    """

    def __init__(
        self,
        message: str,
        *,
        command: tuple[str, ...] = (),
        returncode: int | None = None,
        stderr: str = "",
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.command = command
        self.returncode = returncode
        self.stderr = stderr
        self.attempts = attempts


class TransientSlurmError(SlurmError, TransientError):
    """A Slurm command failed in a way worth retrying: timeout, controller unreachable or busy."""


class SlurmTimeoutError(TransientSlurmError):
    """A Slurm command did not finish within its timeout and was killed."""


class SlurmUnreachableError(TransientSlurmError):
    """The Slurm controller refused or could not take the connection: the request was never delivered."""


class PermanentSlurmError(SlurmError, PermanentError):
    """A Slurm command failed in a way retrying cannot fix: bad job id, permission, invalid option."""


class SlurmJobNotFoundError(PermanentSlurmError):
    """The controller does not know the job id (never existed, or purged after MinJobAge)."""


class SlurmJobStateError(PermanentSlurmError):
    """The job is in a state that does not allow the operation (already finished, pending, not
    requeueable)."""


class ProgressHistoryError(PermanentError):
    """The requeue progress history (a JSON file next to the checkpoints) is unreadable; the message names
    the file and the field."""

    def __init__(self, message: str, *, source: str, field: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.field = field


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10, which has no ``add_note`` (the note is kept in ``__notes__``,
    which 3.10's tracebacks do not print: callers log it too)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
