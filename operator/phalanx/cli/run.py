"""``phalanx run``: the operator, through kopf's runner."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping


def watch_scope(kopf_args: list[str]) -> list[str] | None:
    """The namespaces named by kopf's ``--namespace``/``-n`` options; None for all namespaces."""
    names: list[str] = []
    everywhere = False
    arguments = iter(kopf_args)
    for argument in arguments:
        if argument in ("-A", "--all-namespaces"):
            everywhere = True
        elif argument in ("-n", "--namespace"):
            names.append(next(arguments, ""))
        elif argument.startswith("--namespace="):
            names.append(argument.removeprefix("--namespace="))
        elif argument.startswith("-n") and len(argument) > 2:
            names.append(argument[2:].removeprefix("="))
    if everywhere or not names:
        return None
    globbed = [name for name in names if any(char in name for char in "*?[!")]
    if globbed:
        raise SystemExit(f"phalanx run: namespace patterns are not supported ({', '.join(globbed)}); name them")
    return names


JOB_NETWORK_POLICY_FLAG = "--job-network-policy"
"""Ours, not kopf's: give each job a NetworkPolicy of its own (PHALANX_JOB_NETWORK_POLICY=1)."""


def check_settings(environ: Mapping[str, str]) -> None:
    """Refuse to start on settings the operator cannot use (lease durations that break leader
    election's rules, a bad number, ...), before kopf starts: its start-up handler would only
    stop the operator once kopf is running."""
    from phalanx.handlers.settings import Settings

    try:
        Settings.from_environment(environ)
    except ValueError as error:
        raise SystemExit(f"phalanx run: {error}") from None


NODE_LOST_GRACE_OPTION = "--node-lost-grace-seconds"
FORCE_DELETE_OPTION = "--force-delete-on-node-lost"


def node_options(arguments: list[str]) -> tuple[list[str], dict[str, str]]:
    """Take phalanx's own node options out of the arguments for kopf: the rest, and the environment
    they set (``PHALANX_NODE_LOST_GRACE_SECONDS``, ``PHALANX_FORCE_DELETE_ON_NODE_LOST``)."""
    from phalanx.handlers.settings import FORCE_DELETE_ON_NODE_LOST, NODE_LOST_GRACE

    rest: list[str] = []
    settings: dict[str, str] = {}
    remaining = iter(arguments)
    for argument in remaining:
        if argument == NODE_LOST_GRACE_OPTION:
            settings[NODE_LOST_GRACE] = next(remaining, "")
        elif argument.startswith(f"{NODE_LOST_GRACE_OPTION}="):
            settings[NODE_LOST_GRACE] = argument.removeprefix(f"{NODE_LOST_GRACE_OPTION}=")
        elif argument == FORCE_DELETE_OPTION:
            settings[FORCE_DELETE_ON_NODE_LOST] = "1"
        else:
            rest.append(argument)
    grace = settings.get(NODE_LOST_GRACE)
    if grace is not None and not _seconds(grace):
        raise SystemExit(f"phalanx run: {NODE_LOST_GRACE_OPTION} takes a number of seconds >= 0, not {grace!r}")
    return rest, settings


def _seconds(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def run(kopf_args: list[str]) -> int:
    """Run the operator; every argument but phalanx's own options (``--job-network-policy``, the node
    options) goes to ``kopf run``."""
    from kopf.cli import main as kopf_main

    from phalanx.handlers.settings import JOB_NETWORK_POLICY, WATCH_NAMESPACES

    # The flags become the environment the start-up handler reads its settings from.
    flagged: dict[str, str] = {}
    if JOB_NETWORK_POLICY_FLAG in kopf_args:
        flagged[JOB_NETWORK_POLICY] = "1"
        kopf_args = [argument for argument in kopf_args if argument != JOB_NETWORK_POLICY_FLAG]
    kopf_args, node_settings = node_options(kopf_args)
    flagged.update(node_settings)
    flagged[WATCH_NAMESPACES] = ",".join(watch_scope(kopf_args) or [])
    check_settings({**os.environ, **flagged})
    os.environ.update(flagged)
    kopf_main(["run", "-m", "phalanx.handlers", *kopf_args], standalone_mode=False)
    return 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "run",
        help="run the operator (arguments after it go to `kopf run`, but --job-network-policy: a NetworkPolicy "
        "per job that admits only its own pods, and PHALANX_JOB_NETWORK_POLICY_SCRAPERS to the metrics port)",
    )
    parser.add_argument(
        "kopf_args",
        nargs=argparse.REMAINDER,
        help=(
            "e.g. --all-namespaces --standalone --liveness=http://0.0.0.0:8080/healthz; besides kopf's, "
            f"{NODE_LOST_GRACE_OPTION}=SECONDS (how long a node may be not Ready before its pods are taken "
            f"for lost, default 300) and {FORCE_DELETE_OPTION} (then force-delete them; default: only "
            "when the node object is gone)"
        ),
    )
    parser.set_defaults(func=lambda args: run(args.kopf_args))
