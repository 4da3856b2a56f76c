"""The chaos tier's single-writer check (tests/chaos/audit.py) on hand-written request logs: it
flags a frozen leader that writes after SIGCONT and a standby that writes, and passes legitimate
handovers."""

from __future__ import annotations

from tests.chaos.audit import Sent, single_writer


def lease(process: str, at: float, holder: str, status: int = 200) -> Sent:
    return Sent(process, at, "PUT", "leases", "chaos-phalanx", status, holder)


def write(process: str, at: float, resource: str = "trainingjobs/status", status: int = 200) -> Sent:
    return Sent(process, at, "PATCH", resource, "job-000", status)


def test_a_sigkilled_leaders_successor_and_its_restarted_standby_are_one_writer_at_a_time() -> None:
    log = [
        Sent("a#1", 0.5, "POST", "leases", "chaos-phalanx", 201, "a-1"),
        Sent("b#1", 0.6, "POST", "leases", "chaos-phalanx", 409, "b-1"),  # lost the race to create it
        write("a#1", 1.0),
        lease("a#1", 2.0, "a-1"),  # renewals are not takeovers
        write("a#1", 2.5, "pods"),
        # a#1 is SIGKILLed at 3; its restart a#2 stands by, b#1 takes over after the Lease's duration
        lease("a#2", 9.0, "a-2", status=409),
        lease("b#1", 12.0, "b-1"),
        write("b#1", 12.1),
        Sent("b#1", 12.2, "POST", "events", None, 201),
        lease("b#1", 13.0, "b-1"),
    ]
    takeovers, violations = single_writer(log)
    assert violations == []
    assert [(t.process, t.identity, t.previous) for t in takeovers] == [("a#1", "a-1", None), ("b#1", "b-1", "a#1")]


def test_a_frozen_leader_writing_after_sigcont_is_flagged_with_the_tenure_it_broke() -> None:
    log = [
        lease("a#1", 1.0, "a-1"),
        write("a#1", 2.0),
        # SIGSTOP of a#1 at 3; b#1 takes over at 12; SIGCONT at 15: a#1's pass goes on
        lease("b#1", 12.0, "b-1"),
        write("b#1", 12.5),
        write("a#1", 15.1, "pods", status=201),
        write("a#1", 15.2, status=409),
        lease("a#1", 15.3, "a-1", status=409),  # its renewal fails: it learns it lost the Lease
    ]
    takeovers, violations = single_writer(log, origin=1.0)
    assert len(takeovers) == 2
    assert violations == [
        "a#1 sent 2 write(s) while b#1 held the Lease (taken at 11.00s): "
        "PATCH pods/job-000 at 14.10s (answer 201), PATCH trainingjobs/status/job-000 at 14.20s (answer 409)"
    ]


def test_a_write_sent_before_the_takeover_counts_when_sent_not_when_answered() -> None:
    """Latency in the proxy delays a request after it was received: what counts is when it was sent."""
    log = [lease("a#1", 1.0, "a-1"), write("a#1", 11.9), lease("b#1", 12.0, "b-1")]
    assert single_writer(log)[1] == []
    # the log is in completion order (the delayed write answered last), the check in send order
    assert single_writer(list(reversed(log)))[1] == []


def test_a_standby_that_writes_is_flagged_even_before_anyone_leads() -> None:
    log = [write("b#1", 0.2, "events", status=0), lease("a#1", 1.0, "a-1"), write("b#1", 2.0)]
    _, violations = single_writer(log)
    assert violations == [
        "b#1 sent 1 write(s) before any replica held the Lease: PATCH events/job-000 at 0.20s (answer none)",
        "b#1 sent 1 write(s) while a#1 held the Lease (taken at 1.00s): "
        "PATCH trainingjobs/status/job-000 at 2.00s (answer 200)",
    ]


def test_a_released_lease_leaves_its_last_holder_the_only_writer_until_another_takes_it() -> None:
    log = [
        lease("a#1", 1.0, "a-1"),
        lease("a#1", 5.0, ""),  # a clean stop releases the Lease
        write("a#1", 5.1, "events"),
        lease("b#1", 6.0, "b-1"),
        write("a#1", 6.5, "events"),
    ]
    takeovers, violations = single_writer(log)
    assert [t.process for t in takeovers] == ["a#1", "b#1"]
    assert len(violations) == 1 and violations[0].startswith("a#1 sent 1 write(s) while b#1 held the Lease")


def test_a_restarted_replica_taking_the_lease_back_by_the_same_name_is_a_takeover() -> None:
    """The chart names a replica after its pod: a container restarted after a SIGKILL holds the
    Lease at once, by the same identity, and writes as the new holder."""
    log = [lease("a#1", 1.0, "a"), write("a#1", 2.0), lease("a#2", 4.0, "a"), write("a#2", 4.5), lease("a#2", 5.0, "a")]
    takeovers, violations = single_writer(log)
    assert violations == []
    assert [(t.process, t.previous) for t in takeovers] == [("a#1", None), ("a#2", "a#1")]
