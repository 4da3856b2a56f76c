"""Whether the cluster's schedulable nodes could ever hold a job's workers.

A job waiting for a node the cluster does not have (a worker larger than every node, more workers
than all nodes together can hold) would otherwise wait forever while GitOps tools report it in
progress. Only resources are compared, against allocatable and ignoring what other pods use,
taints and selectors: the answer errs towards "it may fit", so a job is never called impossible
while it could still be scheduled.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from phalanx.reconcile.errors import PlanningError
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


def _container_requests(container: Mapping[str, Any], field: str) -> dict[str, Decimal]:
    resources = container.get("resources") or {}
    requests = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    parsed = {}
    for name, value in requests.items():
        try:
            parsed[name] = parse_quantity(value)
        except QuantityError as error:
            raise PlanningError(f"{field}.resources", f"{value!r} is not a quantity") from error
    return parsed


def _add(total: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, Decimal(0)) + value


def pod_requests(pod_spec: Mapping[str, Any], field: str = "spec.template.spec") -> dict[str, Decimal]:
    """What a pod asks of its node, as the scheduler sums it: its containers' requests (limits
    stand in for missing ones), at least what each init container asks while the sidecars started
    before it run (restartPolicy Always: they run beside the containers too), plus the pod's
    overhead. A quantity that does not parse is a PlanningError naming ``field``'s container."""
    running: dict[str, Decimal] = {}
    for index, container in enumerate(pod_spec.get("containers") or []):
        _add(running, _container_requests(container, f"{field}.containers[{index}]"))
    sidecars: dict[str, Decimal] = {}
    starting: dict[str, Decimal] = {}  # the most any init container needs while it runs
    for index, container in enumerate(pod_spec.get("initContainers") or []):
        requests = _container_requests(container, f"{field}.initContainers[{index}]")
        if container.get("restartPolicy") == "Always":  # a sidecar: runs on beside what follows
            _add(sidecars, requests)
            requests = dict(sidecars)
        else:
            _add(requests, sidecars)
        for name, value in requests.items():
            starting[name] = max(starting.get(name, Decimal(0)), value)
    _add(running, sidecars)
    total = {name: max(running.get(name, Decimal(0)), starting.get(name, Decimal(0))) for name in {*running, *starting}}
    _add(total, parse_allocatable(pod_spec.get("overhead") or {}))
    return total


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


def _amount(name: str, value: Decimal) -> str:
    if name.startswith(DEVICE_CLASS_RESOURCE):
        return f"{format_quantity(value)} device(s) of class {name.removeprefix(DEVICE_CLASS_RESOURCE)}"
    return f"{name} {_readable(value)}"


def shortfall(per_worker: Mapping[str, Decimal], nodes: tuple[Mapping[str, Decimal], ...], wanted: int) -> str | None:
    """Why ``wanted`` workers can never all be placed, or None when they might be."""
    if not nodes:
        return None  # nodes are not watched: nothing is known
    fits = workers_that_fit(per_worker, nodes)
    if fits < 0 or fits >= wanted:
        return None
    size = ", ".join(_amount(name, value) for name, value in sorted(per_worker.items()) if value > 0)
    if fits == 0:
        return f"no schedulable node can hold a worker ({size}); add such a node or ask for less"
    return (
        f"the {len(nodes)} schedulable node(s) can hold at most {fits} worker(s) of this size ({size}), "
        f"fewer than the {wanted} wanted; add nodes or lower workers.desired"
    )


DEVICE_CLASS_RESOURCE = "deviceclass.resource.k8s.io/"
"""Prefix of the pseudo-resource that counts a node's DRA devices of one DeviceClass beside its
allocatable (``<prefix><class>``), so that one comparison judges extended resources and devices."""

_DRIVER_SELECTOR = re.compile(r"""^\s*device\.driver\s*==\s*(?:"([^"\\]+)"|'([^'\\]+)')\s*$""")


def device_class_resource(class_name: str) -> str:
    return DEVICE_CLASS_RESOURCE + class_name


def class_driver(device_class: Mapping[str, Any]) -> str | None:
    """The driver a DeviceClass selects by a ``device.driver == "..."`` selector (the form DRA
    drivers ship), or None when it selects otherwise: its devices are then not counted and no
    judgement is made for it (CEL is the scheduler's to evaluate; a guess might refuse a job
    that fits)."""
    for selector in (device_class.get("spec") or {}).get("selectors") or []:
        match = _DRIVER_SELECTOR.match(str(((selector or {}).get("cel") or {}).get("expression") or ""))
        if match:
            return match.group(1) or match.group(2)
    return None


@dataclass(frozen=True)
class SliceRecord:
    """What the capacity judgement keeps of a ResourceSlice."""

    driver: str
    pool: str
    generation: int
    node: str | None
    """The node whose devices it lists; None for devices reachable from several nodes."""
    devices: int


def slice_record(body: Mapping[str, Any]) -> SliceRecord:
    spec = body.get("spec") or {}
    pool = spec.get("pool") or {}
    return SliceRecord(
        driver=str(spec.get("driver") or ""),
        pool=str(pool.get("name") or ""),
        generation=int(pool.get("generation") or 0),
        node=spec.get("nodeName") or None,
        devices=len(spec.get("devices") or []),
    )


def devices_per_node(slices: Iterable[SliceRecord], drivers: Mapping[str, str | None]) -> dict[str, dict[str, Decimal]]:
    """Node -> (``device_class_resource(class)`` -> devices of the class's driver on it), for the
    DeviceClasses whose driver is known (``drivers``: class -> driver). Only a pool's newest
    generation counts. A driver with devices that are not bound to one node (network-attached,
    a node selector) is left out: its devices could be anywhere, so nothing can be said. Devices
    are counted without the requests' own selectors, which errs towards "it may fit"."""
    slices = list(slices)
    newest: dict[tuple[str, str], int] = {}
    for record in slices:
        key = (record.driver, record.pool)
        newest[key] = max(newest.get(key, record.generation), record.generation)
    unbound = {record.driver for record in slices if record.node is None}
    counts: dict[str, dict[str, int]] = {}  # node -> driver -> devices
    for record in slices:
        if record.node is None or record.driver in unbound or record.generation < newest[(record.driver, record.pool)]:
            continue
        per_driver = counts.setdefault(record.node, {})
        per_driver[record.driver] = per_driver.get(record.driver, 0) + record.devices
    published = {driver for per_driver in counts.values() for driver in per_driver}
    offers: dict[str, dict[str, Decimal]] = {}
    for class_name, driver in drivers.items():
        if driver is None or driver not in published:
            continue
        for node, per_driver in counts.items():
            offers.setdefault(node, {})[device_class_resource(class_name)] = Decimal(per_driver.get(driver, 0))
    return offers
