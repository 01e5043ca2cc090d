"""RequeuePolicy: outcomes x histories -> decisions, the no-progress loop, max_restarts, history JSON."""

from __future__ import annotations

import json
import logging

import pytest

from resilient_slurm.errors import ConfigError, ProgressHistoryError
from resilient_slurm.launcher.policy import (
    HOLD_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    Action,
    Incarnation,
    Outcome,
    ProgressHistory,
    Reason,
    RequeuePolicy,
    replay,
    traceback_location,
)

HISTORY_FILE = "/ckpt/run-7/requeue_history.json"


def hist(*entries: tuple[int | None, int | None]) -> ProgressHistory:
    """A history of (restored_step, committed_step) pairs, restart counts 0, 1, 2, ..."""
    return ProgressHistory(tuple(Incarnation(i, "node_failure", r, c) for i, (r, c) in enumerate(entries)))


EMPTY = ProgressHistory()
# Two restarts in a row that both died before committing past 400.
STUCK2 = hist((None, 400), (400, 400), (400, 400))
PROGRESSING = hist((None, 100), (100, 200), (200, 300))

CASES = [
    # id, policy kwargs, outcome, history, action, exit code, words in the message
    ("completed", {}, Outcome("completed", 500, 400, 2), EMPTY, Action.EXIT, 0, ["completed"]),
    ("completed beats a no-progress streak", {}, Outcome("completed", 400, 400, 3), STUCK2,
     Action.EXIT, 0, ["completed"]),
    ("completed beats max_restarts", {"max_restarts": 1}, Outcome("completed", 500, 400, 5), EMPTY,
     Action.EXIT, 0, ["completed"]),
    ("user error keeps the rank's exit code", {},
     Outcome("user_error", 300, 300, 1, rank=3, exit_code=2, error_location="train.py:57 in forward"),
     PROGRESSING, Action.EXIT, 2, ["rank 3", "exit code 2", "train.py:57 in forward", "not requeued"]),
    ("user error is never requeued nor held", {"max_restarts": 0},
     Outcome("user_error", 400, 400, 3, rank=0, exit_code=1), STUCK2, Action.EXIT, 1, ["rank 0"]),
    ("a restore that refused the checkpoints is not blamed on the program", {},
     Outcome("user_error", 300, None, 1, rank=1, exit_code=1, error_location="train.py:20 in main",
             evidence="resilient_slurm.errors.CorruptCheckpointError: no usable checkpoint of run r"),
     PROGRESSING, Action.EXIT, 1, ["not requeued", "rank 1 could not restore a checkpoint (CorruptCheckpointError",
                                   "rslurm verify"]),
    ("user error without exit code exits 1", {}, Outcome("user_error", None, None, 0), EMPTY,
     Action.EXIT, 1, ["a rank failed"]),
    ("preempted with progress", {}, Outcome("preempted", 200, 100, 1), EMPTY, Action.REQUEUE,
     REQUEUE_EXIT_CODE, ["preemption", "step 200"]),
    ("time limit", {}, Outcome("time_limit", 400, 300, 3), PROGRESSING, Action.REQUEUE, REQUEUE_EXIT_CODE,
     ["time limit", "step 400"]),
    ("cloud termination", {}, Outcome("cloud_termination", 350, 300, 3), PROGRESSING, Action.REQUEUE,
     REQUEUE_EXIT_CODE, ["cloud termination"]),
    ("killed by a signal", {}, Outcome("killed_by_signal", 350, 300, 3, rank=5, signal=9), PROGRESSING,
     Action.REQUEUE, REQUEUE_EXIT_CODE, ["rank 5", "SIGKILL"]),
    ("node failure", {}, Outcome("node_failure", 350, 300, 3, rank=5, node="n2"), PROGRESSING, Action.REQUEUE,
     REQUEUE_EXIT_CODE, ["node failure", "n2"]),
    ("killed by the OOM killer is requeued", {}, Outcome("out_of_memory", 350, 300, 3, rank=1, signal=9),
     PROGRESSING, Action.REQUEUE, REQUEUE_EXIT_CODE, ["out of memory", "OOM killer"]),
    ("out of memory raised by the program is not", {},
     Outcome("out_of_memory", 350, 300, 3, rank=1, exit_code=1, evidence="torch.OutOfMemoryError: CUDA out of memory"),
     PROGRESSING, Action.EXIT, 1, ["not requeued", "rank 1 ran out of memory", "CUDA out of memory"]),
    ("communicator error", {}, Outcome("communicator_error", 350, 300, 3, rank=0, exit_code=1), PROGRESSING,
     Action.REQUEUE, REQUEUE_EXIT_CODE, ["communicator error", "rank 0"]),
    ("cancelled is never requeued, whatever the history", {"max_restarts": 0},
     Outcome("cancelled", 350, 300, 3, job_id="77"), STUCK2, Action.EXIT, 1,
     ["not requeued", "job 77 was cancelled", "step 350 is committed", "same run id"]),
    ("a failed start is requeued", {}, Outcome("startup", None, None, 0, detail="no rank started within 300 s"),
     EMPTY, Action.REQUEUE, REQUEUE_EXIT_CODE, ["a failed start (no rank started within 300 s)"]),
    ("failed starts count for the no-progress rule", {"no_progress_limit": 2},
     Outcome("startup", 400, 400, 2, job_id="5"), hist((None, 400), (400, 400)), Action.HOLD, HOLD_EXIT_CODE,
     ["held: 2 restarts in a row made no progress past step 400", "a failed start"]),
    ("first run preempted before any save", {}, Outcome("preempted", None, None, 0), EMPTY, Action.REQUEUE,
     REQUEUE_EXIT_CODE, ["from the start"]),
    ("third restart in a row without progress is held", {}, Outcome("node_failure", 400, 400, 3, job_id="1234"),
     STUCK2, Action.HOLD, HOLD_EXIT_CODE,
     ["held: 3 restarts in a row made no progress past step 400 (last committed)", "scontrol release 1234"]),
    ("progress breaks the streak", {}, Outcome("preempted", 450, 400, 3), STUCK2, Action.REQUEUE,
     REQUEUE_EXIT_CODE, []),
    ("streak counts only the tail", {}, Outcome("preempted", 300, 300, 4),
     hist((None, 400), (400, 400), (400, 500), (500, 300)), Action.REQUEUE, REQUEUE_EXIT_CODE, []),
    # Restoring an older step after the newest was found corrupt and committing below the newest is not
    # progress: committed_step must pass the previous incarnation's committed step.
    ("fallback to an older checkpoint is not progress", {"no_progress_limit": 1},
     Outcome("node_failure", 450, 400, 1), hist((None, 500)), Action.HOLD, HOLD_EXIT_CODE, ["step 450"]),
    ("no_progress_limit=None disables the rule", {"no_progress_limit": None},
     Outcome("node_failure", 400, 400, 9), hist(*[(400, 400)] * 9), Action.REQUEUE, REQUEUE_EXIT_CODE, []),
    ("no_progress_limit=1 holds at once", {"no_progress_limit": 1}, Outcome("time_limit", None, None, 0),
     EMPTY, Action.HOLD, HOLD_EXIT_CODE, ["1 restarts in a row", "to a first committed step",
                                          "scontrol release <jobid>"]),
    ("max_restarts not yet reached", {"max_restarts": 2}, Outcome("preempted", 300, 200, 1), PROGRESSING,
     Action.REQUEUE, REQUEUE_EXIT_CODE, []),
    ("max_restarts reached", {"max_restarts": 2}, Outcome("preempted", 400, 300, 2, job_id="9"), PROGRESSING,
     Action.HOLD, HOLD_EXIT_CODE, ["restarted 2 times", "max_restarts=2", "RSLURM_MAX_RESTARTS",
                                   "scontrol release 9"]),
    ("max_restarts=0 never requeues", {"max_restarts": 0}, Outcome("preempted", 100, None, 0), EMPTY,
     Action.HOLD, HOLD_EXIT_CODE, ["max_restarts=0"]),
]


@pytest.mark.parametrize(("kwargs", "outcome", "history", "action", "code", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision_table(kwargs: dict, outcome: Outcome, history: ProgressHistory, action: Action, code: int,
                        words: list[str]) -> None:
    decision = RequeuePolicy(**kwargs).decide(outcome, history)
    assert decision.action is action, decision.message
    assert decision.exit_code == code
    for w in words:
        assert w in decision.message


def test_requeue_and_hold_never_exit_zero() -> None:
    # A batch script that exits 0 is recorded COMPLETED and never requeued: if the requeue call fails,
    # the job must not look successful.
    assert REQUEUE_EXIT_CODE != 0 and HOLD_EXIT_CODE != 0


def test_no_progress_rule_named_in_decision() -> None:
    d = RequeuePolicy(max_restarts=3).decide(Outcome("preempted", 400, 400, 3), STUCK2)
    assert (d.action, d.rule) == (Action.HOLD, "no_progress")  # the more specific diagnosis wins


def run_incarnations(policy: RequeuePolicy, outcomes: list[Outcome]) -> list[str]:
    """Drive successive incarnations as the launcher does: read the file, decide, write the file."""
    text: str | None = None  # no history file before the first run
    actions = []
    for outcome in outcomes:
        history = ProgressHistory.parse(text, source=HISTORY_FILE, strict=True)
        decision = policy.decide(outcome, history)
        text = history.record(outcome).to_json()
        actions.append(decision.action.value)
        if decision.action is not Action.REQUEUE:
            break
    return actions


def test_poisoned_checkpoint_loop_is_held_after_k_restarts() -> None:
    # Run 0 saves step 400 and is preempted; step 400's checkpoint makes every restart die right after
    # restore (SIGKILL by the OOM killer: a node_failure). K=3 restarts later the job is held, not looped.
    outcomes = [Outcome("preempted", 400, None, 0)]
    outcomes += [Outcome("node_failure", 400, 400, n, rank=1, signal=9) for n in range(1, 10)]
    assert run_incarnations(RequeuePolicy(no_progress_limit=3), outcomes) == [
        "requeue", "requeue", "requeue", "hold"]
    assert run_incarnations(RequeuePolicy(no_progress_limit=5), outcomes) == ["requeue"] * 5 + ["hold"]


def test_poisoned_checkpoint_with_an_exception_exits_at_once() -> None:
    # The same poison, but the rank raises: an error in the program, never requeued.
    outcomes = [Outcome("preempted", 400, None, 0),
                Outcome("user_error", 400, 400, 1, rank=0, exit_code=1, error_location="model.py:9 in load")]
    assert run_incarnations(RequeuePolicy(), outcomes) == ["requeue", "exit"]


def test_max_restarts_bounds_a_job_that_keeps_progressing() -> None:
    outcomes = [Outcome("preempted", 100 * (n + 1), 100 * n or None, n) for n in range(10)]
    decisions = replay(RequeuePolicy(max_restarts=4), outcomes)
    assert [d.action.value for d in decisions][:6] == ["requeue"] * 4 + ["hold", "hold"]
    assert decisions[4].rule == "max_restarts"


def test_extra_rules_compose() -> None:
    def no_spot_retries(outcome: Outcome, history: ProgressHistory) -> str | None:
        return "held: spot capacity gone" if outcome.reason is Reason.CLOUD_TERMINATION else None

    policy = RequeuePolicy(extra_rules=(no_spot_retries,))
    d = policy.decide(Outcome("cloud_termination", 300, 200, 1), PROGRESSING)
    assert (d.action, d.message, d.rule) == (Action.HOLD, "held: spot capacity gone", "no_spot_retries")
    assert policy.decide(Outcome("preempted", 300, 200, 1), PROGRESSING).action is Action.REQUEUE


@pytest.mark.parametrize("kwargs", [{"no_progress_limit": 0}, {"max_restarts": -1}])
def test_bad_limits_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        RequeuePolicy(**kwargs)


def test_outcome_validation() -> None:
    with pytest.raises(ValueError, match="valid: preempted, time_limit"):
        Outcome("oom")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1..255"):
        Outcome("user_error", exit_code=0)
    with pytest.raises(ValueError, match="restart_count"):
        Outcome("preempted", restart_count=-1)
    assert Outcome("user_error").exit_code == 1
    assert Outcome("time_limit").reason is Reason.TIME_LIMIT


def test_history_json_round_trip() -> None:
    h = EMPTY
    for o in [Outcome("preempted", None, None, 0), Outcome("node_failure", 400, None, 1),
              Outcome("time_limit", 400, 400, 2)]:
        h = h.record(o)
    text = h.to_json()
    assert json.loads(text)["version"] == 2
    back = ProgressHistory.from_json(text, source=HISTORY_FILE)
    assert back == h
    assert back.incarnations[1] == Incarnation(1, "node_failure", None, 400)
    assert back.no_progress_streak() == 1 and back.last_committed() == 400
    assert ProgressHistory.from_json(EMPTY.to_json()) == EMPTY


def test_history_is_bounded() -> None:
    h = EMPTY
    for n in range(10):
        h = h.record(Outcome("node_failure", 400, 400, n), max_entries=4)
    assert [e.restart_count for e in h.incarnations] == [6, 7, 8, 9]
    assert h.no_progress_streak() == 4


def good_doc() -> dict:
    return json.loads(hist((None, 400), (400, 400)).to_json())


def mutate(path: str, value: object) -> str:
    doc = good_doc()
    target = doc
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if k.isdigit() else target[k]
    target[keys[-1]] = value
    return json.dumps(doc)


MALFORMED = [
    ("truncated file", '{"version": 1, "incarn', None, "not valid JSON"),
    ("empty file", "", None, "not valid JSON"),
    ("a list", "[]", None, "expected a JSON object"),
    ("future version", mutate("version", 3), "version", "unsupported version 3"),
    ("evidence not text", mutate("incarnations.0.evidence", 5), "incarnations[0].evidence", "a string"),
    ("time not finite", mutate("incarnations.0.ended_at", "NaN"), "incarnations[0].ended_at", "a time"),
    ("in-job runs not a list", mutate("incarnations.0.in_job", {}), "incarnations[0].in_job", "a list"),
    ("in-job run unknown reason", mutate("incarnations.0.in_job", [{"reason": "oops"}]), "incarnations[0].in_job[0]",
     "known reason"),
    ("no incarnations", json.dumps({"version": 1}), "incarnations", "missing or not a list"),
    ("entry not an object", json.dumps({"version": 1, "incarnations": [3]}), "incarnations[0]", "not an object"),
    ("bad step", mutate("incarnations.1.committed_step", "400"), "incarnations[1].committed_step",
     "expected a step number"),
    ("negative step", mutate("incarnations.0.restored_step", -1), "incarnations[0].restored_step",
     "expected a step number"),
    ("bool restart count", mutate("incarnations.0.restart_count", True), "incarnations[0].restart_count",
     "integer >= 0"),
    ("unknown reason", mutate("incarnations.1.reason", "oom"), "incarnations[1].reason", "unknown reason"),
]


@pytest.mark.parametrize(("text", "field", "words"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_history_names_file_and_field(text: str, field: str | None, words: str) -> None:
    with pytest.raises(ProgressHistoryError) as info:
        ProgressHistory.from_json(text, source=HISTORY_FILE)
    assert info.value.source == HISTORY_FILE and info.value.field == field
    assert HISTORY_FILE in str(info.value) and words in str(info.value)
    if field:
        assert repr(field) in str(info.value)
    with pytest.raises(ProgressHistoryError):
        ProgressHistory.parse(text, source=HISTORY_FILE, strict=True)


def test_unreadable_history_is_empty_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # The launcher's choice: a broken history file must not stop a preempted job from being requeued.
    caplog.set_level(logging.WARNING, logger="resilient_slurm.run_history")
    h = ProgressHistory.parse("{garbage", source=HISTORY_FILE)
    assert h == EMPTY
    assert any(HISTORY_FILE in r.getMessage() and "treating it as empty" in r.getMessage()
               for r in caplog.records)
    decision = RequeuePolicy().decide(Outcome("preempted", 400, 400, 5), h)
    assert decision.action is Action.REQUEUE
    assert ProgressHistory.parse(None, source=HISTORY_FILE) == EMPTY  # no file yet: empty, silently


TRACEBACK = '''\
Traceback (most recent call last):
  File "/opt/lib/loader.py", line 12, in read
    raise KeyError(k)
KeyError: 'w'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 80, in <module>
    main()
  File "/home/u/model.py", line 57, in forward
    return self.w @ x
RuntimeError: shape mismatch
'''


def test_traceback_location() -> None:
    assert traceback_location(TRACEBACK) == "/home/u/model.py:57 in forward"
    assert traceback_location("Killed\n") is None


def test_an_error_raised_in_library_code_names_the_users_line() -> None:
    """A restore that refuses a checkpoint raises inside rslurm: the location is the user's call, with
    the library frame after it (it used to name restore.py alone)."""
    import os

    import torch

    import resilient_slurm

    pkg = os.path.dirname(resilient_slurm.__file__)
    tb = (f'''Traceback (most recent call last):
  File "/home/u/train.py", line 91, in main
    step = ckpt.restore(state)
  File "{pkg}/checkpoint/checkpointer.py", line 212, in restore
    step = self._engine.restore(state, rank_map=rank_map)
  File "{pkg}/checkpoint/restore.py", line 140, in restore
    raise IncompatibleCheckpointError("...")
  File "{os.path.dirname(torch.__file__)}/serialization.py", line 9, in load
    raise X
resilient_slurm.errors.IncompatibleCheckpointError: ...
''')
    assert traceback_location(tb) == f"/home/u/train.py:91 in main (raised in {os.path.dirname(torch.__file__)}/serialization.py:9)"
    only_library = f'''Traceback (most recent call last):
  File "{pkg}/cli.py", line 3, in main
    x()
'''
    assert traceback_location(only_library) == f"{pkg}/cli.py:3 in main"
    # frames of an earlier traceback (the one being handled) do not count as the user's
    assert traceback_location(TRACEBACK + tb) == traceback_location(tb)


def test_history_keeps_the_attribution() -> None:
    from resilient_slurm.launcher.policy import RankRun

    o = Outcome("out_of_memory", 400, 300, 2, rank=1, signal=9, job_id="77", node="n2",
                evidence="rank 1 on n2 killed by SIGKILL; memory cgroup /x: oom_kill 0 -> 1")
    runs = [RankRun("killed_by_signal", "rank 0 killed by SIGSEGV", 350, 1000.5)]
    h = EMPTY.record(o, started_at=900.0, ended_at=1100.0, action="requeue", in_job=runs)
    back = ProgressHistory.from_json(h.to_json(), source=HISTORY_FILE)
    assert back == h
    e = back.incarnations[0]
    assert (e.job_id, e.rank, e.node, e.action, e.started_at, e.ended_at) == ("77", 1, "n2", "requeue", 900.0, 1100.0)
    assert "oom_kill 0 -> 1" in e.evidence and e.in_job == tuple(runs)


def test_version_1_history_still_reads() -> None:
    text = json.dumps({"version": 1, "incarnations": [
        {"restart_count": 0, "reason": "node_failure", "restored_step": None, "committed_step": 400}]})
    h = ProgressHistory.from_json(text, source=HISTORY_FILE)
    assert h.incarnations == (Incarnation(0, "node_failure", None, 400),)


def test_the_rules_count_only_this_jobs_incarnations() -> None:
    """A new submission reusing the run id starts afresh; a requeue (same job id) continues the count."""
    old = [Outcome("killed_by_signal", 400, 400, n, job_id="10") for n in range(3)]
    h = EMPTY
    for o in old:
        h = h.record(o)
    assert h.of_job("10", 3).no_progress_streak() == 3
    assert h.of_job("11", 0) == EMPTY
    h = h.record(Outcome("preempted", 400, 400, 0, job_id="11"))
    assert [e.job_id for e in h.of_job("11", 1).incarnations] == ["11"]
    # Entries without job ids (version 1): restart count 0 is a new submission, as before.
    v1 = hist((None, 400), (400, 400))
    assert v1.of_job("12", 0) == EMPTY and v1.of_job("12", 2) == v1
