"""The chaos tier's long run: at least 200 operator kills across two replicas over at least 50
TrainingJobs.

    python -m tests.benchmarks.bench_chaos [--jobs 60] [--kills 260] [--seed 1] [--busy]

Starts its own control plane with KWOK nodes, runs two operator replicas electing a leader (under
the Helm chart's RBAC, each through a fault proxy of its own) and drives jobs through whole
lifecycles while it injects faults: kills, freezes and slow connections of the leader, API server
crashes, forced relists, node faults, flaps and brownouts, hostile tenants (tests/chaos/driver.py
says which, and which invariants it checks). ``--busy`` runs it on a busy cluster: uneven racks
whose GPUs other tenants' pods hold 60 %, gangs that must run in one rack, cordons, and 30 silent
tenants whose metrics endpoints never answer (``--nodes`` is then unused). Progress goes to
stderr; the figures, the violations and the commit are printed as one JSON object. Exit status 1
when any invariant was violated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from tests.benchmarks.harness import commit, stop_on_signals
from tests.chaos.driver import ChaosConfig, ChaosRun, summary_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_chaos", description=__doc__)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--concurrent", type=int, default=10, help="jobs alive at once (default 10)")
    parser.add_argument("--kills", type=int, default=260, help="operator SIGKILLs planned (default 260)")
    parser.add_argument("--apiserver-restarts", type=int, default=3)
    parser.add_argument("--forced-relists", type=int, default=3)
    parser.add_argument("--watch-cuts", type=int, default=20)
    parser.add_argument("--node-faults", type=int, default=4, help="nodes NotReady past the node-lost grace")
    parser.add_argument("--replicas", type=int, default=2, help="operator replicas electing a leader (default 2)")
    parser.add_argument("--freezes", type=int, default=8, help="leader SIGSTOPs past its Lease (default 8)")
    parser.add_argument("--latency-faults", type=int, default=6)
    parser.add_argument("--flaps", type=int, default=12, help="node Ready flaps of seconds (default 12)")
    parser.add_argument("--brownouts", type=int, default=4, help="half the nodes Unknown at once (default 4)")
    parser.add_argument("--hostile-acts", type=int, default=12, help="hostile tenants' acts, kinds in turn")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--busy", action="store_true", help="a busy cluster (see above)")
    parser.add_argument("--cordons", type=int, default=12, help="node cordons of seconds, when --busy (default 12)")
    args = parser.parse_args(argv)
    config = ChaosConfig(
        jobs=args.jobs,
        concurrent=args.concurrent,
        kills=args.kills,
        apiserver_restarts=args.apiserver_restarts,
        forced_relists=args.forced_relists,
        watch_cuts=args.watch_cuts,
        node_faults=args.node_faults,
        replicas=args.replicas,
        freezes=args.freezes,
        latency_faults=args.latency_faults,
        flaps=args.flaps,
        brownouts=args.brownouts,
        hostile_acts=args.hostile_acts,
        nodes=args.nodes,
        seed=args.seed,
        time_limit=7200.0,
    )
    if args.busy:
        config = dataclasses.replace(
            config, racks=(7, 5, 4, 3, 2), held_share=0.6, cordons=args.cordons, silent_tenants=30
        )
    measured = commit()  # what is being measured, before the run (the tree may change meanwhile)
    scratch = Path(tempfile.mkdtemp(prefix="phalanx-chaos-"))
    with stop_on_signals():
        report = ChaosRun(config, scratch).run()
    if report.violations:  # the operator's log stays for the post-mortem
        print(f"kept {scratch} (operator-a.log, operator-b.log, cluster logs)", file=sys.stderr)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    print(summary_line(report), file=sys.stderr)
    print(json.dumps({"benchmark": "chaos", "commit": measured, "cpus": os.cpu_count(), **report.as_dict()}, indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
