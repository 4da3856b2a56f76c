"""Whether the cluster's schedulable nodes could ever hold a job's workers.

A job waiting for a node the cluster does not have (a worker larger than every node, more workers
than all nodes together can hold) would otherwise wait forever while GitOps tools report it in
progress. Only resources are compared, against allocatable and ignoring what other pods use,
taints and selectors: the answer errs towards "it may fit", so a job is never called impossible
while it could still be scheduled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal

from phalanx.reconcile.quantity import QuantityError, format_quantity, parse_quantity


def parse_allocatable(node: Mapping[str, str]) -> dict[str, Decimal]:
    """A node's ``status.allocatable`` in base units (parsed once per node change, not per pass);
    values that are not quantities are left out."""
    parsed = {}
    for name, value in node.items():
        try:
            parsed[name] = parse_quantity(value)
        except QuantityError:
            continue
    return parsed


def workers_that_fit(per_worker: Mapping[str, Decimal], nodes: Iterable[Mapping[str, Decimal]]) -> int:
    """How many workers the nodes (parsed allocatable) could hold if nothing else ran on them.
    Resources no node lists are left out (the scheduler may not account for them)."""
    offers = list(nodes)
    listed = {name for offer in offers for name in offer}
    wanted = {name: value for name, value in per_worker.items() if value > 0 and name in listed}
    total = 0
    for offer in offers:
        if not wanted:
            return -1  # nothing comparable: unbounded
        total += min(int(offer.get(name, Decimal(0)) // value) for name, value in wanted.items())
    return total


def _readable(value: Decimal) -> str:
    """Bytes as Gi/Mi when they are whole ones (memory), anything else as the API writes it."""
    for suffix, unit in (("Gi", Decimal(2) ** 30), ("Mi", Decimal(2) ** 20)):
        if value >= unit and value % unit == 0:
            return f"{int(value // unit)}{suffix}"
    return format_quantity(value)


def shortfall(per_worker: Mapping[str, Decimal], nodes: tuple[Mapping[str, Decimal], ...], wanted: int) -> str | None:
    """Why ``wanted`` workers can never all be placed, or None when they might be."""
    if not nodes:
        return None  # nodes are not watched: nothing is known
    fits = workers_that_fit(per_worker, nodes)
    if fits < 0 or fits >= wanted:
        return None
    size = ", ".join(f"{name} {_readable(value)}" for name, value in sorted(per_worker.items()) if value > 0)
    if fits == 0:
        return f"no schedulable node can hold a worker ({size}); add such a node or ask for less"
    return (
        f"the {len(nodes)} schedulable node(s) can hold at most {fits} worker(s) of this size ({size}), "
        f"fewer than the {wanted} wanted; add nodes or lower workers.desired"
    )
