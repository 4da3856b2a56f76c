"""Stragglers: a rank whose step time is persistently well above the others'.

Every rank's worker helper reports its recent step time (the median of its last steps) with its
pod's hostname to the job's store (``naming.STEP_TIME_KEY``); the progress poller reads them with
each scrape of the store (``cluster.progress.parse_rank_step_times``) and keeps, per job, the
``StragglerWatch`` this module advances. Pure: no clock, no I/O.

The rule: with at least ``MIN_WORLD`` ranks reporting for the current attempt, a rank is slow in a
poll when its step time is more than ``factor`` times the median of the *others'* (its own time
never lifts the bar it is judged by). It is a straggler once it was slow in ``polls`` consecutive
polls that each brought a new measure of it (its reported step moved): one slow window, a pause
for a checkpoint or a poll that reads the same record again never makes one. A poll in which it
is not slow, or another attempt, starts the count again. A straggler becomes node-ledger evidence
of kind ``Slow`` on its pod's node (``node_ledger.evidence_of``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MIN_WORLD = 3
"""Ranks that must report before any is judged: of two, neither can say which one is slow."""
DEFAULT_FACTOR = 1.5
DEFAULT_POLLS = 3


@dataclass(frozen=True)
class StragglerPolicy:
    """When a rank counts as a straggler (the operator's ``PHALANX_NODE_LEDGER_STRAGGLER_FACTOR``)."""

    factor: float = DEFAULT_FACTOR
    """Slow: more than this many times the median step time of the other ranks."""
    polls: int = DEFAULT_POLLS
    """Consecutive polls, each with a new measure of the rank, it must be slow in."""


@dataclass(frozen=True)
class RankStepTime:
    """One rank's report as the store served it (read as untrusted, already checked)."""

    rank: int
    host: str
    """The hostname of the rank's pod (its name, unless the pod sets a hostname)."""
    seconds: float
    """The median of the rank's last step times."""
    step: int
    """The step the rank had reached when it measured."""


@dataclass(frozen=True)
class Straggler:
    """A rank found persistently slow, with the measured times (shown with the ledger evidence)."""

    rank: int
    host: str
    seconds: float
    others_median: float
    polls: int
    attempt: int = 0
    """The attempt whose ranks it was measured among: no evidence against a later attempt's pod."""

    @property
    def ratio(self) -> float:
        return self.seconds / self.others_median if self.others_median > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"rank {self.rank} at {self.seconds:.3g} s/step, {self.ratio:.1f}x the median "
            f"{self.others_median:.3g} s/step of the other ranks, over {self.polls} polls"
        )


@dataclass(frozen=True)
class StragglerWatch:
    """What one job's polls have shown so far: per rank, its consecutive slow polls and the step
    of its last measure counted."""

    attempt: int | None = None
    slow_polls: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """rank -> (consecutive slow polls, the step of the last one counted)."""
    stragglers: tuple[Straggler, ...] = ()


def slow_ranks(times: Iterable[RankStepTime], factor: float) -> dict[int, tuple[RankStepTime, float]]:
    """The ranks slow in one poll, with the median of the others' step times; none below MIN_WORLD ranks."""
    ranks = {one.rank: one for one in times}
    if len(ranks) < MIN_WORLD:
        return {}
    slow: dict[int, tuple[RankStepTime, float]] = {}
    for rank, one in ranks.items():
        others = statistics.median(other.seconds for other in ranks.values() if other.rank != rank)
        if one.seconds > factor * others:
            slow[rank] = (one, others)
    return slow


def observe(
    watch: StragglerWatch | None, attempt: int, times: Iterable[RankStepTime], policy: StragglerPolicy
) -> StragglerWatch:
    """The watch after one poll of the current attempt's step times."""
    if watch is None or watch.attempt != attempt:
        watch = StragglerWatch(attempt=attempt)
    slow = slow_ranks(times, policy.factor)
    counts: dict[int, tuple[int, int]] = {}
    stragglers: list[Straggler] = []
    for rank, (one, others) in sorted(slow.items()):
        polls, last_step = watch.slow_polls.get(rank, (0, -1))
        if one.step > last_step:  # a new measure: counts
            polls, last_step = polls + 1, one.step
        counts[rank] = (polls, last_step)
        if polls >= policy.polls:
            stragglers.append(Straggler(one.rank, one.host, one.seconds, others, polls, attempt))
    return StragglerWatch(attempt=attempt, slow_polls=counts, stragglers=tuple(stragglers))
