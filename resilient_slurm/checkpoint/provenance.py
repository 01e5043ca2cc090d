"""Provenance: what produced a checkpoint, recorded in every manifest (``manifest.Manifest.provenance``).

Who calls what: the :class:`~.checkpointer.Checkpointer` calls :func:`check_user_config` on the
``config=`` it is given (a clear error at construction, not at the first save), then :func:`gather`
once, on the ranks that write manifests (domain leaders) and on rank 0 (it compares code versions at a
restore); the engine copies the result into each manifest it writes. Nothing here runs per save: git
runs once, with a timeout, and a missing git, a program outside a repository or a git that hangs gives
null fields, never an error.

The code version is the git commit of the repository holding the *program* (``__main__``'s file, else
``sys.argv[0]``), not of the current directory: a job started from a scratch directory still records
the code it ran. Fields (JSON):

``code``: ``git_commit`` (str), ``git_dirty`` (bool: tracked files differ from the commit),
``git_root`` (the repository's top directory) and ``program`` (its path), each null when unknown;
``command_line`` (``sys.argv``); ``python``, ``torch``, ``cuda``, ``nccl`` (null without CUDA),
``rslurm`` versions; ``world_size``; ``nodes``: the run's storage domains, which are named after the
node of their lowest rank; ``slurm``: ``job_id``, ``array_job_id``, ``array_task_id``, ``restart_count``,
``job_nodelist`` (null outside Slurm); ``config`` (the user's ``Checkpointer(config=...)``, JSON) and
``config_sha256`` (of its canonical JSON), null when none was given; ``integration``: the rslurm
integration the program trains through (``lightning``, ``hf``; null for a loop of its own) and
``frameworks``: the versions of ``lightning``, ``transformers`` and ``accelerate`` when the program
imported them (each null otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import __version__
from ..errors import ConfigError, CorruptCheckpointError
from ..jobenv import JobEnv

log = logging.getLogger(__name__)

MAX_USER_CONFIG_BYTES = 64 << 10  # in every manifest of every domain: a config, not a dataset
GIT_TIMEOUT_S = 5.0

Runner = Callable[[Sequence[str], str], "str | None"]
INTEGRATIONS = ("lightning", "hf")  # resilient_slurm.integrations.<name>: imported only by programs that use it
FRAMEWORKS = ("lightning", "transformers", "accelerate")


def canonical_json(value: Any) -> str:
    """The bytes that :func:`config_sha256` hashes: sorted keys, no spaces, NaN refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_sha256(value: Any) -> str:
    """sha256 of the canonical JSON of a user config (two equal configs hash equal, whatever their key order)."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def check_user_config(value: Any) -> Any:
    """The user config as JSON will store it (tuples become lists), or ConfigError naming what is wrong:
    not JSON-serialisable (a tensor, a path object, NaN), keys that are not strings, or larger than
    :data:`MAX_USER_CONFIG_BYTES`."""
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"Checkpointer(config=...) must be JSON-serialisable (dicts with string keys, lists, strings, "
            f"finite numbers, booleans, None): {exc}. Convert it first, e.g. vars(args) or "
            "dataclasses.asdict(cfg), with str() for paths") from None
    if len(text) > MAX_USER_CONFIG_BYTES:
        raise ConfigError(f"Checkpointer(config=...) is {len(text)} bytes as JSON, more than the "
                          f"{MAX_USER_CONFIG_BYTES} a manifest keeps; pass the settings that define the run, "
                          "not data")
    if not all(isinstance(k, str) for k in _keys(value)):
        raise ConfigError("Checkpointer(config=...): every dict key must be a string (JSON would turn "
                          "others into strings, and the stored config would differ from yours); a transformers "
                          "config's to_dict() has integer id2label keys: pass "
                          "json.loads(model.config.to_json_string()), what save_pretrained writes")
    return json.loads(text)


def _keys(v: Any) -> list[Any]:
    if isinstance(v, Mapping):
        return [*v.keys(), *(k for x in v.values() for k in _keys(x))]
    if isinstance(v, (list, tuple)):
        return [k for x in v for k in _keys(x)]
    return []


def program_dir(main_file: str | None = None, argv0: str | None = None) -> str | None:
    """The directory of the running program: ``__main__.__file__``, else ``sys.argv[0]`` when it is a
    file; None for an interactive session or ``python -c``."""
    if main_file is None:
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    for cand in (main_file, argv0 if argv0 is not None else (sys.argv[0] if sys.argv else None)):
        if cand and os.path.isfile(cand):
            return os.path.dirname(os.path.abspath(cand))
    return None


def _run_git(args: Sequence[str], cwd: str) -> str | None:
    """stdout of ``git -C cwd args``, or None when git is missing, fails or takes longer than the timeout."""
    try:
        out = subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                             stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("git %s in %s: %s", " ".join(args), cwd, exc)
        return None
    if out.returncode != 0:
        return None
    return out.stdout


def code_version(where: str | None, run: Runner = _run_git) -> dict[str, Any]:
    """``git_commit``, ``git_dirty``, ``git_root`` of the repository holding directory ``where`` (all None
    when git is missing, ``where`` is None or is not in a repository)."""
    out: dict[str, Any] = {"git_commit": None, "git_dirty": None, "git_root": None}
    if where is None:
        return out
    head = run(["rev-parse", "HEAD", "--show-toplevel"], where)
    lines = (head or "").split()
    if len(lines) != 2:
        return out
    out["git_commit"], out["git_root"] = lines
    status = run(["status", "--porcelain", "--untracked-files=no"], where)
    out["git_dirty"] = None if status is None else bool(status.strip())
    return out


def _cuda_versions() -> tuple[str | None, str | None]:
    import torch

    if not torch.cuda.is_available():
        return None, None
    cuda = torch.version.cuda
    nccl: str | None = None
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # a build without NCCL
        nccl = None
    return cuda, nccl


def gather(*, world_size: int, nodes: Sequence[str], job: JobEnv, user_config: Any = None,
           has_config: bool = False, argv: Sequence[str] | None = None, where: str | None = None,
           run: Runner = _run_git) -> dict[str, Any]:
    """The provenance document (fields in the module docstring). ``where``: the program's directory
    (default :func:`program_dir`); ``user_config`` was checked by :func:`check_user_config`."""
    import torch

    cuda, nccl = _cuda_versions()
    folder = where if where is not None else program_dir()
    code = code_version(folder, run)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    code["program"] = os.path.abspath(main_file) if main_file else None
    return {
        "code": code,
        "command_line": list(sys.argv if argv is None else argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": cuda,
        "nccl": nccl,
        "rslurm": __version__,
        "world_size": world_size,
        "nodes": sorted(set(nodes)),
        "slurm": {
            "job_id": job.job_id, "array_job_id": job.array_job_id, "array_task_id": job.array_task_id,
            "restart_count": job.restart_count, "job_nodelist": job.job_nodelist or job.nodelist,
        },
        "config": user_config if has_config else None,
        "config_sha256": config_sha256(user_config) if has_config else None,
        "integration": next((name for name in INTEGRATIONS if f"resilient_slurm.integrations.{name}" in sys.modules),
                            None),
        "frameworks": {f: getattr(sys.modules.get(f), "__version__", None) for f in FRAMEWORKS},
    }


def stored_config(prov: Mapping[str, Any] | None, *, where: str) -> str | None:
    """The user config a manifest's provenance records, as the canonical JSON its ``config_sha256`` was
    computed over (so the text's sha256 is that field), after checking it against that field; None when the
    step was saved without one (or before provenance existed). ``prov`` went through
    ``manifest.parse_provenance``. CorruptCheckpointError naming ``where`` (the manifest) when the config
    does not match its sha256, is not JSON a save could have written (NaN), or has no sha256 to check."""
    if not isinstance(prov, Mapping):
        return None
    value, sha = prov.get("config"), prov.get("config_sha256")
    if sha is None:
        if value is None:
            return None
        raise CorruptCheckpointError(f"{where}: provenance records a config but no config_sha256 (a hex string) "
                                     "to check it against; the manifest was altered after the save")
    try:
        text = canonical_json(value)
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: the config recorded in provenance is not JSON a save writes "
                                     f"({exc}); the manifest was altered after the save") from None
    got = hashlib.sha256(text.encode()).hexdigest()
    if got != sha:
        raise CorruptCheckpointError(f"{where}: the config recorded in provenance does not match its config_sha256 "
                                     f"(its sha256 is {got[:16]}..., the manifest records {str(sha)[:16]}...); the "
                                     "config or its sha256 was altered after the save")
    return text


def git_commit(prov: Mapping[str, Any] | None) -> str | None:
    """The git commit a provenance document records, or None (no provenance, not a repository)."""
    code = (prov or {}).get("code")
    commit = code.get("git_commit") if isinstance(code, Mapping) else None
    return commit if isinstance(commit, str) else None


__all__ = ["MAX_USER_CONFIG_BYTES", "check_user_config", "code_version", "config_sha256", "gather", "git_commit",
           "program_dir", "stored_config"]
