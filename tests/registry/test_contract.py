"""The registry contract, run unchanged against the in-memory backend and a real etcd server.

Whatever one backend does, the other must do too: the Core and the agents are written against
this contract, not against a backend.
"""

from __future__ import annotations

import math
import threading
import time

import pytest

from core_service.registry import Fence, FenceLost, KVEvent, LeaderElection, LeaseNotFound, Registry, TxnWrite
from tests.registry.helpers import EXPIRY_SLACK_S, EventRecorder, lease_ttl

pytestmark = pytest.mark.timeout(60)


# --- plain key-value semantics ------------------------------------------------------------------


def test_put_get_overwrite_and_revisions(registry: Registry) -> None:
    assert registry.get("/kv/a") is None
    r1 = registry.put("/kv/a", b"one")
    r2 = registry.put("/kv/a", b"two")
    r3 = registry.put("/kv/b", b"")
    assert r1 < r2 < r3
    assert registry.get("/kv/a") == b"two"
    assert registry.get("/kv/b") == b"", "an empty value is a value, not an absent key"


def test_get_prefix_is_sorted_and_respects_the_prefix_boundary(registry: Registry) -> None:
    for key in ["/p/b", "/p/a/2", "/p/a/1", "/pa", "/q/x"]:
        registry.put(key, key.encode())
    assert registry.get_prefix("/p/") == [("/p/a/1", b"/p/a/1"), ("/p/a/2", b"/p/a/2"), ("/p/b", b"/p/b")]
    assert registry.get_prefix("/p") == [
        ("/p/a/1", b"/p/a/1"),
        ("/p/a/2", b"/p/a/2"),
        ("/p/b", b"/p/b"),
        ("/pa", b"/pa"),
    ]
    assert registry.get_prefix("/nothing/") == []


def test_delete_and_delete_prefix(registry: Registry) -> None:
    for key in ["/d/x/1", "/d/x/2", "/d/xy", "/d/y"]:
        registry.put(key, b"v")
    assert registry.delete("/d/y") is True
    assert registry.delete("/d/y") is False
    assert registry.delete_prefix("/d/x/") == 2
    assert registry.delete_prefix("/d/x/") == 0
    assert registry.get_prefix("/d/") == [("/d/xy", b"v")]


def test_create_is_put_if_absent(registry: Registry) -> None:
    assert registry.create("/c/k", b"first") is True
    assert registry.create("/c/k", b"second") is False
    assert registry.get("/c/k") == b"first"
    registry.delete("/c/k")
    assert registry.create("/c/k", b"third") is True
    assert registry.get("/c/k") == b"third"
    # The comparison comes first: an existing key refuses the write before the lease is looked at.
    assert registry.create("/c/k", b"fourth", lease=987654321) is False


def test_compare_and_swap(registry: Registry) -> None:
    assert registry.compare_and_swap("/cas/k", b"x", b"v1") is False, "absent key never equals a value"
    assert registry.get("/cas/k") is None
    assert registry.compare_and_swap("/cas/k", None, b"v1") is True
    assert registry.compare_and_swap("/cas/k", None, b"v2") is False
    assert registry.compare_and_swap("/cas/k", b"wrong", b"v2") is False
    assert registry.get("/cas/k") == b"v1"
    assert registry.compare_and_swap("/cas/k", b"v1", b"v2") is True
    assert registry.get("/cas/k") == b"v2"


def test_compare_and_swap_writes_its_companions_all_or_nothing(registry: Registry) -> None:
    plans = [("/txn/plans/1", b"plan-1"), ("/txn/audit", b"a")]
    assert registry.compare_and_swap("/txn/epoch", b"0", b"1", also=plans) is False
    assert [registry.get(k) for k in ("/txn/epoch", "/txn/plans/1", "/txn/audit")] == [None, None, None]
    assert registry.compare_and_swap("/txn/epoch", None, b"1", also=plans) is True
    assert [registry.get(k) for k in ("/txn/epoch", "/txn/plans/1", "/txn/audit")] == [b"1", b"plan-1", b"a"]
    with pytest.raises(ValueError, match="compared key"):
        registry.compare_and_swap("/txn/epoch", b"1", b"2", also=[("/txn/epoch", b"3")])
    with pytest.raises(ValueError, match="twice"):
        registry.compare_and_swap("/txn/epoch", b"1", b"2", also=[("/txn/x", b"1"), ("/txn/x", b"2")])
    with pytest.raises(TypeError, match="pairs"):
        registry.compare_and_swap("/txn/epoch", b"1", b"2", also=[("/txn/x",)])  # type: ignore[list-item]
    with pytest.raises(LeaseNotFound):
        registry.compare_and_swap("/txn/epoch", b"1", b"2", lease=987654321, also=[("/txn/y", b"y")])
    assert (
        registry.get("/txn/epoch") == b"1"
        and registry.get("/txn/x") is None
        and registry.get("/txn/y") is None
    )


def test_transact_compares_every_key_and_writes_in_one_revision_or_not_at_all(registry: Registry) -> None:
    registry.put("/tx/a", b"1")
    registry.put("/tx/gone", b"old")
    writes = [TxnWrite("/tx/new", b"n"), TxnWrite("/tx/gone", None), TxnWrite("/tx/absent", None)]
    failed = registry.transact([("/tx/a", b"1"), ("/tx/b", b"2")], writes)
    assert not failed.succeeded and failed.current == (b"1", None), "what the compared keys held"
    assert registry.get("/tx/new") is None and registry.get("/tx/gone") == b"old"
    recorder = EventRecorder()
    with registry.watch_prefix("/tx/", recorder):
        assert registry.transact([("/tx/a", b"1"), ("/tx/b", None)], writes).succeeded
        events = recorder.wait_for(lambda evs: len(evs) == 2, timeout_s=5)
    assert {(e.kind, e.key) for e in events} == {("put", "/tx/new"), ("delete", "/tx/gone")}
    assert events[0].revision == events[1].revision, "one transaction, one revision"
    assert registry.get_prefix("/tx/") == [("/tx/a", b"1"), ("/tx/new", b"n")]


# --- fenced writes: only while a fence key (the leader key) holds the expected value ------------------


def test_fenced_put_and_delete_apply_only_while_the_fence_holds(registry: Registry) -> None:
    fence = Fence("/f/leader", b"core-a")
    registry.put(fence.key, b"core-a")
    registry.put_fenced(fence, "/f/members/w0", b"record")
    registry.put_fenced(fence, "/f/events/1", b"event")
    registry.delete_fenced(fence, "/f/events/1")
    registry.delete_fenced(fence, "/f/events/never-written")  # nothing to delete is no error
    assert registry.get_prefix("/f/") == [("/f/leader", b"core-a"), ("/f/members/w0", b"record")]

    registry.put(fence.key, b"core-b")  # another Core leads now
    recorder = EventRecorder()
    with registry.watch_prefix("/f/", recorder):
        with pytest.raises(FenceLost, match="fence '/f/leader' holds b'core-b', not b'core-a'") as lost:
            registry.put_fenced(fence, "/f/members/w0", b"stale")
        assert lost.value.holder == b"core-b" and lost.value.fence == fence
        assert "put '/f/members/w0' refused" in str(lost.value) and "nothing was written" in str(lost.value)
        with pytest.raises(FenceLost, match="delete '/f/members/w0' refused"):
            registry.delete_fenced(fence, "/f/members/w0")
        registry.delete(fence.key)  # nobody leads
        with pytest.raises(FenceLost, match="is absent") as absent:
            registry.put_fenced(fence, "/f/members/w1", b"stale")
        assert absent.value.holder is None
        registry.put("/f/sentinel", b"s")
        events = recorder.wait_for_key("put", "/f/sentinel", timeout_s=5)
    assert [(e.kind, e.key) for e in events] == [("delete", "/f/leader"), ("put", "/f/sentinel")]
    assert registry.get_prefix("/f/") == [("/f/members/w0", b"record"), ("/f/sentinel", b"s")]


def test_fenced_writes_follow_the_election_that_holds_the_fence(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    leader = LeaderElection(registry, "/fe/leader", "core-a", ttl)
    standby = LeaderElection(registry, "/fe/leader", "core-b", ttl)
    assert leader.campaign(timeout_s=5)
    registry.put_fenced(leader.fence, "/fe/members/w0", b"from a")
    with pytest.raises(FenceLost):
        registry.put_fenced(standby.fence, "/fe/members/w0", b"from b")
    # The leader's lease ends (as after a partition) and the standby takes the key.
    lease = leader.lease_id
    assert lease is not None
    leader.abandon()  # its keepalive stops, but nothing here tells the old leader it lost
    registry.revoke_lease(lease)
    assert standby.campaign(timeout_s=5)
    with pytest.raises(FenceLost, match=r"holds b'core-b\\n#term=\w+', not b'core-a\\n#term="):
        registry.put_fenced(leader.fence, "/fe/members/w0", b"late write from a")
    registry.put_fenced(standby.fence, "/fe/members/w0", b"from b")
    assert registry.get("/fe/members/w0") == b"from b"
    standby.resign()


def test_compare_and_swap_with_a_fence_needs_both_the_fence_and_the_expected_value(
    registry: Registry,
) -> None:
    fence = Fence("/fc/leader", b"core-a")
    registry.put(fence.key, b"core-a")
    companions = [("/fc/plans/1", b"plan")]
    assert registry.compare_and_swap("/fc/epoch", b"7", b"1", also=companions, fence=fence) is False
    assert registry.compare_and_swap("/fc/epoch", None, b"1", also=companions, fence=fence) is True
    registry.put(fence.key, b"core-b")
    with pytest.raises(FenceLost, match="compare-and-swap of '/fc/epoch' refused"):
        registry.compare_and_swap("/fc/epoch", b"1", b"2", also=[("/fc/plans/2", b"late")], fence=fence)
    assert registry.get_prefix("/fc/") == [
        ("/fc/epoch", b"1"),
        ("/fc/leader", b"core-b"),
        ("/fc/plans/1", b"plan"),
    ]
    with pytest.raises(ValueError, match="own fence key"):
        registry.compare_and_swap("/fc/epoch", b"1", b"2", also=[(fence.key, b"core-a")], fence=fence)


def test_fenced_writes_refuse_bad_input_before_writing(registry: Registry) -> None:
    fence = Fence("/fb/leader", b"core-a")
    registry.put(fence.key, b"core-a")
    with pytest.raises(ValueError, match="own fence key"):
        registry.put_fenced(fence, fence.key, b"core-z")
    with pytest.raises(ValueError, match="own fence key"):
        registry.delete_fenced(fence, fence.key)
    with pytest.raises(TypeError, match="must be a Fence"):
        registry.put_fenced(("/fb/leader", b"core-a"), "/fb/k", b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        registry.put_fenced(fence, "/fb/k", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one write"):
        registry.transact([(fence.key, b"core-a")], [])
    with pytest.raises(ValueError, match="twice"):
        registry.transact([], [TxnWrite("/fb/k", b"1"), TxnWrite("/fb/k", None)])
    assert registry.get_prefix("/fb/") == [("/fb/leader", b"core-a")]


def test_racing_creates_have_exactly_one_winner(registry: Registry) -> None:
    threads, start = 8, threading.Barrier(8)
    results: dict[int, bool] = {}

    def contend(i: int) -> None:
        start.wait(timeout=10)
        results[i] = registry.create("/race/leader", f"candidate-{i}".encode())

    workers = [threading.Thread(target=contend, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    winners = [i for i, won in results.items() if won]
    assert len(results) == threads
    assert len(winners) == 1
    assert registry.get("/race/leader") == f"candidate-{winners[0]}".encode()


def test_cas_increments_lose_no_update(registry: Registry) -> None:
    """Read-modify-write through CAS from several threads equals the serial count."""
    threads, increments = 4, 15
    registry.put("/counter", b"0")

    def increment_many() -> None:
        for _ in range(increments):
            while True:
                current = registry.get("/counter")
                assert current is not None
                if registry.compare_and_swap("/counter", current, str(int(current) + 1).encode()):
                    break

    workers = [threading.Thread(target=increment_many) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=50)
    assert registry.get("/counter") == str(threads * increments).encode()


# --- leases -------------------------------------------------------------------------------------


def test_lease_expiry_deletes_attached_keys_and_the_watch_sees_it(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    recorder = EventRecorder()
    registry.put("/job/members/w1", b"record")  # persistent: must survive the lease
    with registry.watch_prefix("/job/", recorder):
        lease = registry.grant_lease(ttl)
        registry.put("/job/alive/w1", b"1", lease=lease)
        registry.put("/job/alive/w2", b"1", lease=lease)
        granted_at = time.monotonic()
        recorder.wait_for(
            lambda evs: {e.key for e in evs if e.kind == "delete"} == {"/job/alive/w1", "/job/alive/w2"},
            timeout_s=ttl + EXPIRY_SLACK_S,
        )
        assert time.monotonic() - granted_at > ttl * 0.5, "expired far too early"
    assert registry.get_prefix("/job/") == [("/job/members/w1", b"record")]
    deletes = [e for e in recorder.events if e.kind == "delete"]
    assert all(e.value is None for e in deletes)
    assert deletes[0].revision > max(e.revision for e in recorder.events if e.kind == "put")


def test_refresh_keeps_keys_alive_past_the_ttl(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    lease = registry.grant_lease(ttl)
    registry.put("/alive/w", b"1", lease=lease)
    until = time.monotonic() + 1.5 * ttl
    while time.monotonic() < until:
        registry.refresh_lease(lease)
        assert registry.get("/alive/w") == b"1"
        time.sleep(ttl / 4)
    registry.refresh_lease(lease)
    assert registry.get("/alive/w") == b"1"


def test_refresh_revoke_and_put_after_expiry_raise_lease_not_found(registry: Registry) -> None:
    ttl = lease_ttl(registry)
    lease = registry.grant_lease(ttl)
    registry.put("/exp/k", b"1", lease=lease)
    deadline = time.monotonic() + ttl + EXPIRY_SLACK_S
    while registry.get("/exp/k") is not None:
        assert time.monotonic() < deadline, "leased key outlived ttl + slack"
        time.sleep(0.05)
    with pytest.raises(LeaseNotFound):
        registry.refresh_lease(lease)
    with pytest.raises(LeaseNotFound):
        registry.revoke_lease(lease)
    with pytest.raises(LeaseNotFound):
        registry.put("/exp/k2", b"1", lease=lease)
    with pytest.raises(LeaseNotFound):
        registry.create("/exp/k3", b"1", lease=lease)
    assert registry.get_prefix("/exp/") == []


def test_revoke_deletes_every_attached_key_now(registry: Registry) -> None:
    recorder = EventRecorder()
    lease = registry.grant_lease(60)
    other = registry.grant_lease(60)
    registry.put("/rv/a", b"1", lease=lease)
    registry.put("/rv/b", b"1", lease=lease)
    registry.put("/rv/c", b"1", lease=other)
    registry.put("/rv/d", b"1")
    with registry.watch_prefix("/rv/", recorder):
        registry.revoke_lease(lease)
        assert registry.get_prefix("/rv/") == [("/rv/c", b"1"), ("/rv/d", b"1")]
        events = recorder.wait_for(lambda evs: len(evs) >= 2, timeout_s=5)
    assert sorted((e.kind, e.key) for e in events) == [("delete", "/rv/a"), ("delete", "/rv/b")]
    with pytest.raises(LeaseNotFound):
        registry.refresh_lease(lease)
    registry.revoke_lease(other)


def test_put_without_lease_detaches_the_key(registry: Registry) -> None:
    lease = registry.grant_lease(60)
    registry.put("/det/k", b"leased", lease=lease)
    registry.put("/det/k", b"plain")
    registry.revoke_lease(lease)
    assert registry.get("/det/k") == b"plain"


# --- watches ------------------------------------------------------------------------------------


def test_watch_delivers_every_change_in_order_on_a_background_thread(registry: Registry) -> None:
    recorder = EventRecorder()
    expected: list[KVEvent] = []
    with registry.watch_prefix("/w/", recorder):
        registry.put("/outside", b"ignored")
        for i in range(30):
            key = f"/w/{i % 4}"
            if i % 5 == 4:
                existed = registry.get(key) is not None
                registry.delete(key)
                if existed:
                    expected.append(KVEvent("delete", key, None, -1))
            else:
                rev = registry.put(key, str(i).encode())
                expected.append(KVEvent("put", key, str(i).encode(), rev))
        events = recorder.wait_for(lambda evs: len(evs) >= len(expected), timeout_s=10)
    assert [(e.kind, e.key, e.value) for e in events] == [(e.kind, e.key, e.value) for e in expected]
    put_revisions = [
        (got.revision, want.revision)
        for got, want in zip(events, expected, strict=True)
        if want.kind == "put"
    ]
    assert all(got == want for got, want in put_revisions), "a put event carries the revision put returned"
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
    assert threading.get_ident() not in recorder.threads


def test_cancelled_watch_gets_nothing_more_and_a_failing_callback_does_not_stop_a_watch(
    registry: Registry,
) -> None:
    cancelled, survivor = EventRecorder(), EventRecorder()
    calls = []

    def explode(event: KVEvent) -> None:
        calls.append(event.key)
        raise RuntimeError("callback bug")

    first = registry.watch_prefix("/cw/", cancelled)
    with registry.watch_prefix("/cw/", explode), registry.watch_prefix("/cw/", survivor):
        registry.put("/cw/1", b"1")
        cancelled.wait_for_key("put", "/cw/1", timeout_s=5)
        first.cancel()
        first.cancel()  # idempotent
        registry.put("/cw/2", b"2")
        survivor.wait_for_key("put", "/cw/2", timeout_s=5)
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [e.key for e in cancelled.events] == ["/cw/1"]
    assert calls == ["/cw/1", "/cw/2"], "the watch kept going after its callback raised"


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda r: r.put("", b"v"), ValueError, "non-empty"),
        (lambda r: r.put("/k", "text"), TypeError, "bytes"),
        (lambda r: r.put(b"/k", b"v"), TypeError, "str"),
        (lambda r: r.put("/k", b"v", lease=0), ValueError, "positive"),
        (lambda r: r.put("/k", b"v", lease=987654321), LeaseNotFound, "not found"),
        (lambda r: r.create("/new", b"v", lease=987654321), LeaseNotFound, "not found"),
        (lambda r: r.compare_and_swap("/new", None, b"v", lease=987654321), LeaseNotFound, "not found"),
        (lambda r: r.compare_and_swap("/k", "old", b"v"), TypeError, "expected"),
        (lambda r: r.grant_lease(0), ValueError, "positive"),
        (lambda r: r.grant_lease(-1.0), ValueError, "positive"),
        (lambda r: r.grant_lease(math.nan), ValueError, "finite"),
        (lambda r: r.grant_lease("2"), TypeError, "seconds"),
        (lambda r: r.refresh_lease(987654321), LeaseNotFound, "not found"),
        (lambda r: r.revoke_lease(987654321), LeaseNotFound, "not found"),
        (lambda r: r.delete_prefix(""), ValueError, "non-empty"),
        (lambda r: r.get_prefix(""), ValueError, "non-empty"),
        (lambda r: r.watch_prefix("/k", "not callable"), TypeError, "callable"),
    ],
)
def test_bad_input_is_refused_clearly_and_changes_nothing(
    registry: Registry, call: object, error: type[Exception], words: str
) -> None:
    registry.put("/k", b"original")
    recorder = EventRecorder()
    with registry.watch_prefix("/", recorder):
        with pytest.raises(error, match=words):
            call(registry)  # type: ignore[operator]
        registry.put("/sentinel", b"s")
        events = recorder.wait_for_key("put", "/sentinel", timeout_s=5)
    assert [e.key for e in events] == ["/sentinel"], "the refused call must not have written anything"
    assert registry.get_prefix("/") == [("/k", b"original"), ("/sentinel", b"s")]
