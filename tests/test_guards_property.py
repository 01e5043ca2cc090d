"""Every file the product reads or writes under a run, a tier's root or a config path, attacked the same way
(docs/architecture.md, "Inputs and their guards"): a symbolic link at each component of its path below the
root, a FIFO, a character device, a directory, a huge sparse file, deeply nested JSON, wrong types, control
characters and extreme numbers in every field. Property-based (hypothesis, derandomized, a bounded number
of examples per reader, so it runs in seconds and the same way every time).

For every reader and mutation: it returns, or raises only the error its table row names, at once (no FIFO
or device blocks it: a 10 s alarm would fail the example); nothing outside the root is written (the link
targets are digested before and after); and through a link it never takes the linked content for its own.
The identifiers (run ids, tags, node names, steps) go through their one validation the same way, and
:func:`~resilient_slurm.terminal.printable` leaves no control character in any string.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import string
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_slurm import Checkpointer, config
from resilient_slurm.catalog.history import format_history, read_history
from resilient_slurm.checkpoint import stragglers
from resilient_slurm.checkpoint.metadata_pickle import read_checked_metadata
from resilient_slurm.checkpoint.metrics import MetricsLog, read_metrics
from resilient_slurm.control.heartbeat import register_stack_dump, unregister_stack_dump
from resilient_slurm.daemon.drain import scan_local
from resilient_slurm.daemon.service import read_status
from resilient_slurm.errors import ConfigError, CorruptCheckpointError, StorageError, TagsFileError
from resilient_slurm.layout import RunWriter, claim_run
from resilient_slurm.paths import MAX_STEP, check_id, id_problem
from resilient_slurm.storage.fileio import atomic_write
from resilient_slurm.tags import read_local_tags, tag_name_problem
from resilient_slurm.telemetry import EventLog
from resilient_slurm.terminal import printable

RUN = "r1"
STEP = "step_000000000001"
HUGE = 64 << 20  # over every cap of a JSON file rslurm reads (a manifest's is 256 MiB: tested elsewhere)
CONTROL = "".join(chr(c) for c in (*range(0, 32), *range(127, 160))) + "\u202e\u2066\ufeff"
SETTINGS = settings(derandomize=True, max_examples=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------ readers
@dataclass(frozen=True)
class Reader:
    """One row of the table: the file's path below the root, its reader (a summary of what it took from
    the file; ``None``/empty when it took nothing), and the errors it may raise."""

    name: str
    rel: tuple[str, ...]
    read: Callable[[Path], Any]
    allowed: tuple[type[BaseException], ...] = ()
    follows_links: bool = False  # a file the user names (the config file): its links are the user's


def _steps_and_metadata(root: Path) -> Any:
    bad: list[str] = []
    steps = scan_local(str(root), [RUN], invalid=lambda p, why: bad.append(why))
    return [(s.step, len(read_checked_metadata(os.path.join(s.path, ".metadata"), s.manifest.dcp_metadata)))
            for s in steps]


def _tags(root: Path) -> Any:
    t = read_local_tags(str(root / RUN), RUN)
    return t.tags if t is not None else None


def _history(root: Path) -> Any:
    h = read_history(str(root), RUN)
    text = format_history([h])
    assert all(c not in text for c in "\x1b\x07\x00\x9b")
    return (h.source, len(h.history.incarnations)) if h.source else None


def _metrics_write(root: Path) -> Any:
    m = MetricsLog(str(root / RUN), 0, 1)
    m.resume(3)
    m.record(4, {"loss": 1.0})
    m.close()


def _events_write(root: Path) -> Any:
    EventLog(str(root), RUN, source="daemon", node="n1", keep_open=False).emit("probe", step=1)


def _history_write(root: Path) -> Any:
    atomic_write(str(root / RUN / "launcher-history.json"), b"{}", root=str(root))


def _claim(root: Path) -> Any:
    claim_run(str(root), RUN, RunWriter.this_process(None)).release()


def _stacks(root: Path) -> Any:
    unregister_stack_dump(register_stack_dump(str(root / RUN), 0))


def _config(root: Path) -> Any:
    return config.load({}, env={}, config_path=str(root / "config.toml")).keep_last


READERS = [
    Reader("manifest and .metadata (scan, read)", (RUN, STEP, "manifest.json"), _steps_and_metadata,
           (CorruptCheckpointError,)),
    Reader("DCP .metadata", (RUN, STEP, ".metadata"), _steps_and_metadata, (CorruptCheckpointError,)),
    Reader("tags.json", (RUN, "tags.json"), _tags, (TagsFileError,)),
    Reader("launcher-history.json (read)", (RUN, "launcher-history.json"), _history),
    Reader("launcher-history.json (write)", (RUN, "launcher-history.json"), _history_write, (ConfigError, StorageError)),
    Reader("metrics (read)", (RUN, "metrics", "rank0.jsonl"), lambda root: read_metrics(str(root / RUN))),
    Reader("metrics (cut, append)", (RUN, "metrics", "rank0.jsonl"), _metrics_write),
    Reader("events.jsonl (append)", (RUN, "events.jsonl"), _events_write),
    Reader("stragglers.json", (RUN, "stragglers.json"), lambda root: stragglers.read_status(str(root / RUN))),
    Reader("stacks/rank<r>.txt (faulthandler)", (RUN, "stacks", "rank0.txt"), _stacks),
    Reader(".rslurm/daemon.json", (".rslurm", "daemon.json"), lambda root: read_status(str(root))),
    Reader(".rslurm/run-<id>.lock", (".rslurm", f"run-{RUN}.lock"), _claim, (ConfigError,)),
    Reader("config file", ("config.toml",), _config, (ConfigError,), follows_links=True),
]


# ------------------------------------------------------------------------------------------ a good tree
@pytest.fixture(scope="module")
def good_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local root holding every file above, each valid (one real step, tags, history, metrics...)."""
    root = tmp_path_factory.mktemp("good") / "root"
    with Checkpointer(local_dir=str(root), run_id=RUN, keep_last=10) as ck:
        ck.save(1, {"w": torch.ones(64), "n": 1})
        ck.tag(1, "best")
    run = root / RUN
    (run / "launcher-history.json").write_text(json.dumps({"version": 2, "incarnations": [
        {"restart_count": 0, "reason": "preempted", "restored_step": None, "committed_step": 1,
         "started_at": 1.7e9, "ended_at": 1.7e9 + 60, "evidence": "SIGTERM"}]}))
    (run / "metrics").mkdir(exist_ok=True)
    (run / "metrics" / "rank0.jsonl").write_text("".join(json.dumps({"step": s, "world": 1, "m": {"loss": s}}) + "\n"
                                                         for s in range(1, 6)))
    (run / "stragglers.json").write_text(json.dumps({"version": 1, "at": 1.7e9, "step": 5, "stragglers": []}))
    (root / ".rslurm").mkdir(mode=0o700, exist_ok=True)
    (root / ".rslurm" / "daemon.json").write_text(json.dumps({"version": 1, "steps": []}))
    (root / "config.toml").write_text("keep_last = 5\n")
    return root


def _digest(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = ("link" if p.is_symlink() else
                                             hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return out


@contextlib.contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def fire(*_: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------ mutations
_numbers = st.sampled_from([1e308, -1e308, -1, 2**70, -(2**70), 0, 253402300800.0, 1.5, True, None])
_strings = st.text(alphabet=st.sampled_from(list(CONTROL + "ab./")), min_size=0, max_size=12)
_json = st.recursive(_numbers | _strings, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(["step", "at", "m", "world", "tags", "version", "format",
                                                        "run_id", "incarnations", "stragglers", "steps", "job_id",
                                                        "pid", "host", "token", "started_at", "keep_last"]),
                                       inner, max_size=4), max_leaves=8)


def _replace_leaf(doc: Any, path: list[int], value: Any) -> Any:
    """``doc`` with one value (chosen by ``path``) replaced by ``value``: wrong types in every field."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    k = keys[path[0] % len(keys)]
    new = dict(doc) if isinstance(doc, dict) else list(doc)
    new[k] = _replace_leaf(doc[k], path[1:], value)
    return new


mutations = st.one_of(
    st.tuples(st.just("link"), st.integers(0, 3)),
    st.tuples(st.just("fifo")), st.tuples(st.just("device")), st.tuples(st.just("dir")), st.tuples(st.just("huge")),
    st.tuples(st.just("nested"), st.integers(40, 200_000)),
    st.tuples(st.just("field"), st.lists(st.integers(0, 7), max_size=4), _json),
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
    st.tuples(st.just("numbers"), st.sampled_from(["1e999", "NaN", "-Infinity", "1" * 5000, "-1", "1e308"])),
)


def _apply(root: Path, elsewhere: Path, reader: Reader, mutation: tuple[Any, ...]) -> bool:
    """Mutate the reader's file (or a directory on its path) in ``root``; True for a link mutation."""
    target = root.joinpath(*reader.rel)
    kind = mutation[0]
    if kind == "link":
        i = mutation[1] % len(reader.rel)
        comp = root.joinpath(*reader.rel[: i + 1])
        copy = elsewhere / f"copy-{i}"
        if comp.is_dir():
            shutil.copytree(comp, copy, symlinks=True)
            shutil.rmtree(comp)
        else:
            shutil.copy2(comp, copy) if comp.exists() else copy.write_text("{}")
            comp.unlink(missing_ok=True)
        comp.parent.mkdir(parents=True, exist_ok=True)
        comp.symlink_to(copy)
        return True
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        os.mknod(target, 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers: endless zeros
    elif kind == "dir":
        target.mkdir()
    elif kind == "huge":
        with open(target, "wb") as f:
            f.truncate(HUGE)
    elif kind == "nested":
        target.write_bytes(b"[" * mutation[1] + b"]" * mutation[1])
    elif kind == "bytes":
        target.write_bytes(mutation[1])
    elif kind == "numbers":
        target.write_text('{"version": 2, "step": %s, "at": %s, "incarnations": [], "keep_last": %s}' % ((mutation[1],) * 3))
    elif kind == "field":  # one value of the good file replaced: wrong types, control characters, extremes
        good = GOOD.get(reader.rel, b"")
        value = mutation[2]
        try:
            if target.suffix == ".jsonl":
                lines = [json.loads(x) for x in good.splitlines() if x.strip()]
                text = "".join(json.dumps(x) + "\n" for x in _replace_leaf(lines, mutation[1] or [0], value))
            elif target.suffix == ".toml":
                text = f"keep_last = {json.dumps(value)}\nrun_id = {json.dumps(str(value))}\n"
            else:
                text = json.dumps(_replace_leaf(json.loads(good), mutation[1], value))
        except ValueError:  # not a JSON file (.metadata: a pickle; the lock: absent): the value alone
            text = json.dumps(value)
        target.write_text(text)
    return False


GOOD: dict[tuple[str, ...], bytes] = {}


def _took_nothing(summary: Any) -> bool:
    return summary in (None, [], {}, ()) or (isinstance(summary, dict) and not any(summary.values()))


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root (CI runs as root)")
@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_every_reader_survives_every_mutation(reader: Reader, good_tree: Path) -> None:
    for r in READERS:
        p = good_tree.joinpath(*r.rel)
        if p.is_file():
            GOOD[r.rel] = p.read_bytes()

    @SETTINGS
    @given(mutation=mutations)
    def check(mutation: tuple[Any, ...]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root, elsewhere = Path(tmp) / "root", Path(tmp) / "elsewhere"
            shutil.copytree(good_tree, root, symlinks=True)
            elsewhere.mkdir()
            linked = _apply(root, elsewhere, reader, mutation)
            before = _digest(elsewhere)
            summary: Any = None
            with _alarm(10):
                try:
                    summary = reader.read(root)
                except reader.allowed as exc:
                    assert str(root) in str(exc) or "config" in str(exc), f"{exc} names no file"
            assert _digest(elsewhere) == before, f"{reader.name}: written outside the root through {mutation}"
            if linked and not reader.follows_links and reader.read not in (_metrics_write, _events_write,
                                                                           _history_write, _claim, _stacks):
                assert _took_nothing(summary), f"{reader.name}: read through a link ({mutation}): {summary}"

    check()


# ------------------------------------------------------------------------------------------ identifiers
@SETTINGS
@given(value=st.text(alphabet=st.sampled_from(list(CONTROL + string.ascii_letters + string.digits + "./-_ \\~%")),
                     max_size=300) | st.sampled_from(["..", ".", "/abs", "a/b", "../esc", "", "x" * 129, "0" * 13]))
def test_one_validation_of_identifiers(value: str) -> None:
    for kind in ("run id", "tag", "node name"):
        problem = id_problem(kind, value)
        if problem is None:
            assert value not in (".", "..") and os.path.basename(value) == value and value.isprintable()
            assert printable(value) == value and not value.startswith((".", "-"))
            assert check_id(kind, value) == value
        else:
            with pytest.raises(ConfigError):
                check_id(kind, value)
    assert tag_name_problem(value) == id_problem("tag", value)  # the tags module asks the same function
    parse = config.SETTINGS["run_id"].parse
    if id_problem("run id", value) is None:
        assert parse(value) == value
    else:
        with pytest.raises(ValueError):
            parse(value)
    step = id_problem("step", value)
    assert (step is None) == (value.isascii() and value.isdigit() and int(value) <= MAX_STEP)


@SETTINGS
@given(text=st.text(max_size=200))
def test_printable_leaves_no_control_character(text: str) -> None:
    shown = printable(text)
    assert all(c.isprintable() for c in shown), repr(shown)
    assert all(c.isprintable() or c in "\n\t" for c in printable(text, newlines=True))
    if text.isprintable():
        assert shown == text
