"""The restore plan (checkpoint/restore_plan.py), in process: which steps a restore tries, newest first,
and where each domain that lacks one takes it from, for listings laid out by hand. Starts no process."""

from __future__ import annotations

import pytest

from resilient_slurm.checkpoint.coordination import Topology
from resilient_slurm.checkpoint.peers import Held
from resilient_slurm.checkpoint.restore_plan import Listing, no_restore, plan_restore
from resilient_slurm.errors import CorruptCheckpointError, RestoreUnavailableError

# Four ranks in two storage domains: ranks 0 and 1 on node a (leader 0), ranks 2 and 3 on node b (leader 2).
TOPO = Topology(rank=0, world_size=4, node="a", domain_of_rank=("a", "a", "b", "b"), root="/x", nonce="n")
SAVE = 1000.0


def _leader(committed: list[int], *, held: tuple[Held, ...] = (), saved_at: dict[int, float] | None = None,
            durable: list[int] | None = None, durable_error: str | None = None) -> Listing:
    return Listing(committed, durable, durable_error, held,
                   {s: SAVE for s in committed} if saved_at is None else saved_at)


def _other(durable: list[int] | None = None, durable_error: str | None = None) -> Listing:
    return Listing(None, durable, durable_error, (), {})


def _listings(a: list[int], b: list[int], *, durable: list[int] | None = None, durable_error: str | None = None,
              held_a: tuple[Held, ...] = (), held_b: tuple[Held, ...] = (),
              saved_a: dict[int, float] | None = None, saved_b: dict[int, float] | None = None) -> list[Listing]:
    """Rank 0 leads domain a (and lists the durable tier), rank 2 leads domain b."""
    return [_leader(a, held=held_a, saved_at=saved_a, durable=durable, durable_error=durable_error), _other(),
            _leader(b, held=held_b, saved_at=saved_b), _other()]


def _steps(listings: list[Listing]) -> list[int]:
    return [c.step for c in plan_restore(listings, TOPO).candidates]


def test_a_step_on_every_domain_is_a_local_candidate_newest_first() -> None:
    plan = plan_restore(_listings([10, 20, 30], [10, 20, 30]), TOPO)
    assert [c.step for c in plan.candidates] == [30, 20, 10]
    assert all(c.local and not c.peers and not c.durable for c in plan.candidates)
    assert all(c.save_of == SAVE for c in plan.candidates)
    assert plan.existing == (10, 20, 30)
    assert plan.stranded == () and plan.mixed == () and plan.unreachable == () and not plan.lacks


def test_a_step_missing_on_one_domain_is_fetched_where_it_is_durable() -> None:
    plan = plan_restore(_listings([10, 20], [10], durable=[10, 20]), TOPO)
    first, second = plan.candidates
    assert (first.step, first.lacking, first.durable, first.local, first.peers) == (20, (2,), True, False, {})
    assert first.save_of == SAVE  # the save of domain a's copy: a durable copy of another save is refused
    assert (second.step, second.local, second.durable) == (10, True, True)
    assert plan.stranded == () and plan.lacks == {"b": [20]}


def test_a_step_missing_on_one_domain_and_not_durable_is_no_candidate() -> None:
    plan = plan_restore(_listings([10, 20], [10]), TOPO)
    assert [c.step for c in plan.candidates] == [10]
    assert plan.stranded == (20,) and plan.lacks == {"b": [20]}
    assert plan.existing == (10, 20)


def test_a_partners_replica_completes_a_step() -> None:
    replica = Held(domain="b", step=20, world_size=4, ranks=(2, 3), created_at=SAVE)
    plan = plan_restore(_listings([10, 20], [10], held_a=(replica,)), TOPO)
    first = plan.candidates[0]
    assert (first.step, first.lacking, first.peers, first.durable) == (20, (2,), {2: (0, "b")}, False)
    assert plan.stranded == ()


def test_a_replica_of_another_save_or_other_ranks_completes_nothing() -> None:
    other_save = Held(domain="b", step=20, world_size=4, ranks=(2, 3), created_at=SAVE + 1)
    other_ranks = Held(domain="b", step=20, world_size=4, ranks=(2,), created_at=SAVE)
    other_world = Held(domain="b", step=20, world_size=2, ranks=(2, 3), created_at=SAVE)
    for held in (other_save, other_ranks, other_world):
        assert _steps(_listings([10, 20], [10], held_a=(held,))) == [10]


def test_replicas_alone_of_a_step_no_domain_committed() -> None:
    """Both domains lost step 30 but each holds the other's replica: every lacking domain has a source."""
    held_a = (Held(domain="b", step=30, world_size=4, ranks=(2, 3), created_at=SAVE),)
    held_b = (Held(domain="a", step=30, world_size=4, ranks=(0, 1), created_at=SAVE),)
    plan = plan_restore(_listings([10], [10], held_a=held_a, held_b=held_b), TOPO)
    first = plan.candidates[0]
    assert (first.step, first.lacking, dict(first.peers)) == (30, (0, 2), {0: (2, "a"), 2: (0, "b")})
    assert first.save_of is None and plan.existing == (10,)


def test_durable_only_steps_are_candidates_every_domain_fetches() -> None:
    plan = plan_restore(_listings([], [], durable=[5, 15]), TOPO)
    assert [(c.step, c.lacking, c.durable) for c in plan.candidates] == [(15, (0, 2), True), (5, (0, 2), True)]
    assert plan.existing == (5, 15)


def test_a_step_committed_by_two_saves_is_never_a_candidate() -> None:
    plan = plan_restore(_listings([10, 20], [10, 20], durable=[20], saved_b={10: SAVE, 20: SAVE + 5}), TOPO)
    assert [c.step for c in plan.candidates] == [10]
    assert plan.mixed == (20,)


def test_nothing_anywhere_is_a_fresh_start() -> None:
    plan = plan_restore(_listings([], []), TOPO)
    assert plan.candidates == () and plan.existing == () and plan.unreachable == ()
    assert no_restore("/run", plan.existing, plan.unreachable, "fail") is None
    assert no_restore("/run", plan.existing, plan.unreachable, "fresh") is None


def test_an_unlistable_durable_tier_is_unreachable() -> None:
    plan = plan_restore(_listings([], [], durable_error="s3: timed out"), TOPO)
    assert plan.candidates == () and plan.unreachable == ("s3: timed out",)
    out = no_restore("/run or s3://b", plan.existing, plan.unreachable, "fail")
    assert out is not None and isinstance(out.error, RestoreUnavailableError)
    assert str(out.error).startswith("no checkpoint could be found in /run or s3://b because the durable tier "
                                     "failed (s3: timed out). Not starting over from step 0")


@pytest.mark.parametrize("fallback", ["fail", "fresh"])
def test_restore_fallback_when_steps_exist_but_none_restored(fallback: str) -> None:
    out = no_restore("/run", [10, 20], [], fallback)
    assert out is not None
    assert out.message.startswith("committed steps [10, 20] exist in /run but none could be restored")
    if fallback == "fresh":
        assert out.error is None and out.message == "committed steps [10, 20] exist in /run but none could be restored"
    else:
        assert isinstance(out.error, CorruptCheckpointError)
        assert str(out.error).endswith("`rslurm verify` names what is wrong with each step")


def test_restore_fallback_fresh_after_a_storage_failure_starts_over() -> None:
    out = no_restore("/run", [10], ["fetch failed", "fetch failed", "timeout"], "fresh")
    assert out is not None and out.error is None
    assert out.message.endswith("because the durable tier failed (fetch failed; timeout)")


def test_steps_listed_by_some_leaders_only_and_ranks_that_list_nothing() -> None:
    """Only leaders' listings count (the other ranks list None), and only rank 0's durable listing."""
    listings = _listings([10, 20, 30], [20, 30])
    listings[1] = Listing(None, [99], "ignored", (), {})  # not a leader, not rank 0: its fields are ignored
    plan = plan_restore(listings, TOPO)
    assert [c.step for c in plan.candidates] == [30, 20]
    assert plan.stranded == (10,) and plan.lacks == {"b": [10]} and plan.unreachable == ()


def test_one_domain_per_rank() -> None:
    topo = Topology(rank=1, world_size=3, node="b", domain_of_rank=("a", "b", "c"), root="/x", nonce="n")
    listings = [_leader([1, 2, 3], durable=[3]), _leader([1, 3]), _leader([1, 2])]
    plan = plan_restore(listings, topo)
    assert [(c.step, c.lacking, c.durable) for c in plan.candidates] == [(3, (2,), True), (1, (), False)]
    assert plan.stranded == (2,) and plan.lacks == {"b": [2], "c": [3]}
