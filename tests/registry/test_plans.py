"""Epoch-fenced plan store on both backends."""

from __future__ import annotations

import threading

import pytest

from core_service.registry import FenceLost, LeaderElection, PlanStore, Registry, StaleEpoch
from tests.registry.helpers import lease_ttl

pytestmark = pytest.mark.timeout(60)

PREFIX = "/elaswave"


def test_publish_allocates_consecutive_epochs_under_the_documented_keys(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    assert store.latest("job1") is None
    assert store.current_epoch("job1") == 0
    assert [store.publish("job1", f'{{"n": {i}}}'.encode()) for i in range(3)] == [1, 2, 3]
    assert store.epochs("job1") == [1, 2, 3]
    assert store.latest("job1") == (3, b'{"n": 2}')
    assert store.get("job1", 2) == b'{"n": 1}'
    assert store.get("job1", 9) is None
    assert registry.get(f"{PREFIX}/jobs/job1/plans/{1:020d}") == b'{"n": 0}'
    assert registry.get(f"{PREFIX}/jobs/job1/epoch") == b"3"
    assert store.latest("other-job") is None, "jobs do not share epochs"
    assert store.publish("other-job", b"{}") == 1


def test_epoch_order_matches_numeric_order_past_nine(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    for i in range(12):
        store.publish("job", str(i).encode())
    assert store.epochs("job") == list(range(1, 13))
    assert store.latest("job") == (12, b"11")


def test_expected_epoch_fences_a_stale_publisher(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    assert store.publish("job", b"a", expected_epoch=0) == 1
    with pytest.raises(StaleEpoch, match="expected epoch 0, current epoch is 1") as info:
        store.publish("job", b"stale", expected_epoch=0)
    assert (info.value.expected, info.value.current) == (0, 1)
    assert store.epochs("job") == [1] and store.latest("job") == (1, b"a"), "a fenced publish writes nothing"
    assert store.publish("job", b"b", expected_epoch=1) == 2


def test_concurrent_publishers_get_distinct_gapless_epochs(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    publishers, plans_each = 4, 6
    start = threading.Barrier(publishers)
    allocated: dict[int, bytes] = {}
    lock = threading.Lock()

    def publish_many(p: int) -> None:
        start.wait(timeout=10)
        for i in range(plans_each):
            plan = f"publisher {p} plan {i}".encode()
            epoch = store.publish("job", plan)
            with lock:
                assert epoch not in allocated, f"epoch {epoch} handed out twice"
                allocated[epoch] = plan

    workers = [threading.Thread(target=publish_many, args=(p,)) for p in range(publishers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=50)
    total = publishers * plans_each
    assert sorted(allocated) == list(range(1, total + 1))
    assert {e: store.get("job", e) for e in allocated} == allocated, "each epoch holds its publisher's plan"


def test_publishers_racing_on_the_same_expected_epoch_have_one_winner(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    store.publish("job", b"base")
    contenders, start = 6, threading.Barrier(6)
    outcomes: list[object] = []

    def contend(i: int) -> None:
        start.wait(timeout=10)
        try:
            outcomes.append(store.publish("job", f"c{i}".encode(), expected_epoch=1))
        except StaleEpoch as exc:
            outcomes.append(exc)

    workers = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert sorted(o for o in outcomes if isinstance(o, int)) == [2]
    assert sum(isinstance(o, StaleEpoch) for o in outcomes) == contenders - 1
    assert store.epochs("job") == [1, 2]


def test_a_deposed_leader_cannot_publish_over_its_successor(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    store = PlanStore(registry, PREFIX)
    old = LeaderElection(registry, f"{PREFIX}/core/leader", "core-a", ttl)
    new = LeaderElection(registry, f"{PREFIX}/core/leader", "core-b", ttl)
    assert old.campaign(timeout_s=5)
    seen_by_old = store.publish("job", b"plan from a", expected_epoch=store.current_epoch("job"))
    old.abandon()  # partitioned: it still believes the epoch it last saw
    assert new.campaign(timeout_s=ttl + 3)
    assert store.publish("job", b"plan from b", expected_epoch=store.current_epoch("job")) == seen_by_old + 1
    with pytest.raises(StaleEpoch):
        store.publish("job", b"late plan from a", expected_epoch=seen_by_old)
    assert store.latest("job") == (seen_by_old + 1, b"plan from b")
    new.resign()


def test_a_deposed_leader_that_saw_the_latest_epoch_is_stopped_by_the_leader_fence(
    registry: Registry,
) -> None:
    ttl = lease_ttl(registry)
    store = PlanStore(registry, PREFIX)
    old = LeaderElection(registry, f"{PREFIX}/core/leader", "core-a", ttl)
    new = LeaderElection(registry, f"{PREFIX}/core/leader", "core-b", ttl)
    assert old.campaign(timeout_s=5)
    assert store.publish("job", b"plan from a", expected_epoch=0, fence=old.fence) == 1
    old.abandon()  # partitioned; its successor has published nothing yet, so epoch 1 is still current
    assert new.campaign(timeout_s=ttl + 3)
    with pytest.raises(FenceLost, match="holds b'core-b"):
        store.publish("job", b"late plan from a", expected_epoch=1, fence=old.fence)
    assert store.epochs("job") == [1] and store.current_epoch("job") == 1
    assert store.publish("job", b"plan from b", expected_epoch=1, fence=new.fence) == 2
    new.resign()


def test_watch_reports_each_new_plan_with_its_epoch(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    store.publish("job", b"before the watch")
    seen: list[tuple[int, bytes]] = []
    three_seen = threading.Event()

    def on_plan(epoch: int, plan: bytes) -> None:
        seen.append((epoch, plan))
        if len(seen) >= 3:
            three_seen.set()

    with store.watch("job", on_plan):
        store.publish("other", b"not this job")
        for i in range(3):
            store.publish("job", f"p{i}".encode())
        assert three_seen.wait(timeout=10)
    assert seen == [(2, b"p0"), (3, b"p1"), (4, b"p2")]


def test_prune_keeps_the_newest_plans(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    for i in range(5):
        store.publish("job", str(i).encode())
    assert store.prune("job", keep=2) == 3
    assert store.epochs("job") == [4, 5]
    assert store.publish("job", b"next") == 6, "pruning never rewinds the epoch"


def test_latest_falls_back_to_the_newest_stored_plan(registry: Registry) -> None:
    store = PlanStore(registry, PREFIX)
    store.publish("job", b"one")
    # A publisher that died after allocating epoch 2 and before writing its plan.
    registry.compare_and_swap(store.epoch_key("job"), b"1", b"2")
    assert store.latest("job") == (1, b"one")
    assert store.publish("job", b"three") == 3


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda s: s.publish("a/b", b"{}"), ValueError, "must not contain '/'"),
        (lambda s: s.publish("", b"{}"), ValueError, "non-empty"),
        (lambda s: s.publish("job", "{}"), TypeError, "plan_json must be bytes"),
        (lambda s: s.publish("job", b"{}", expected_epoch=-1), ValueError, "expected_epoch"),
        (lambda s: s.get("job", -3), ValueError, "epoch"),
        (lambda s: s.prune("job", keep=0), ValueError, "keep"),
        (lambda s: s.watch("job", None), TypeError, "callable"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    registry: Registry, call: object, error: type[Exception], words: str
) -> None:
    store = PlanStore(registry, PREFIX)
    store.publish("job", b"{}")
    before = registry.get_prefix(PREFIX)
    with pytest.raises(error, match=words):
        call(store)  # type: ignore[operator]
    assert registry.get_prefix(PREFIX) == before


def test_prefix_must_be_absolute(registry: Registry) -> None:
    with pytest.raises(ValueError, match="prefix"):
        PlanStore(registry, "elaswave")
    with pytest.raises(ValueError, match="prefix"):
        PlanStore(registry, "/elaswave/")
