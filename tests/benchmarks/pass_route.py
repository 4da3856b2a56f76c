"""The route one planning pass of a running job takes through phalanx's modules, as it runs.

``python -m tests.benchmarks.pass_route`` settles a simulated three-worker job (tests/unit/simulation)
into Running, then traces one more pass (``plan.plan``: decide, then render; the ``Observed`` it
plans from is built before the trace starts) and prints JSON: the
modules it entered, how often control moved from one module to another (``module_changes``, calls
and returns alike), how many of those went back to a module it had already left (``returns``), and
the deepest chain of calls from module to module open at once (``deepest_module_chain``). A
structural measure, not a timing: the figures are exact and repeat. Run it at two commits to
compare a refactor (a checkout of the older commit, with this file copied into it).
"""

from __future__ import annotations

import itertools
import json
import sys
from types import FrameType
from typing import Any

from phalanx.reconcile.plan import plan
from tests.benchmarks.harness import commit
from tests.unit.jobs import job
from tests.unit.simulation import World, running


def phalanx_module(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.startswith("phalanx.") else None


def traced_pass(world: World) -> tuple[list[str], int]:
    """The module control is in after each call and return of one pass, and the deepest chain."""
    trail: list[str] = []
    frames: list[tuple[str, int]] = []  # each open phalanx frame: its module, its chain length
    deepest = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal deepest
        module = phalanx_module(frame)
        if module is None or event not in ("call", "return"):
            return
        if event == "call":
            parent = frames[-1] if frames else None
            chain = 1 if parent is None else parent[1] + (parent[0] != module)
            frames.append((module, chain))
            deepest = max(deepest, chain)
            trail.append(module)
        elif frames:
            frames.pop()
            if frames:
                trail.append(frames[-1][0])

    job, observed, now = world.job, world.observed(), world.now
    sys.setprofile(profile)
    try:
        plan(job, observed, now)
    finally:
        sys.setprofile(None)
    return trail, deepest


def route() -> dict[str, Any]:
    trail, deepest = traced_pass(running(World(job())))
    changes = [module for previous, module in itertools.pairwise(trail) if module != previous]
    seen = set(trail[:1])
    returns = 0
    for module in changes:
        returns += module in seen
        seen.add(module)
    return {
        "commit": commit(),
        "modules_entered": len(seen),
        "module_changes": len(changes),
        "returns": returns,
        "deepest_module_chain": deepest,
        "modules": sorted(seen),
    }


if __name__ == "__main__":
    print(json.dumps(route(), indent=2))
