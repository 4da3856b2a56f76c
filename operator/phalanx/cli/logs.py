"""``phalanx logs JOB``: the logs of a TrainingJob's workers, each line prefixed with its worker.

Without ``-f`` the workers of one attempt are printed one after the other, in index order. With
``-f`` all of them stream at once and the command keeps following the job (its pods are
watched): a replaced worker and the workers of a new attempt join as they start, until the job
ends. The work is done in ``log_streams``, imported when the command runs.
"""

from __future__ import annotations

import argparse

from phalanx.cli import connection


def parse_duration(text: str) -> int:
    """Seconds in a Go-style duration as kubectl's ``--since`` takes it: ``30s``, ``10m``, ``1h30m``."""
    units = {"h": 3600, "m": 60, "s": 1}
    total, number = 0.0, ""
    for char in text.strip():
        if char.isdigit() or char == ".":
            number += char
        elif char in units and number:
            total += float(number) * units[char]
            number = ""
        else:
            raise ValueError(f"invalid duration {text!r}: use units h, m and s, as in 10m or 1h30m")
    if number or not text.strip():
        raise ValueError(f"invalid duration {text!r}: a number needs a unit (h, m or s), as in 10m")
    return max(1, int(total))


def _run(args: argparse.Namespace) -> int:
    from phalanx.cli import log_streams

    return connection.execute(args, lambda: log_streams.logs(args))


def _duration(text: str) -> int:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a non-negative integer: {text!r}")
    return int(text)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "logs",
        help="print the logs of a TrainingJob's workers",
        description="Print the logs of the workers of a TrainingJob's current attempt, each line prefixed with"
        " its worker. With -f, stream them as they come and keep following the job (replaced workers and"
        " new attempts join) until it succeeds or fails.",
    )
    parser.add_argument("job", metavar="JOB", help="name of the TrainingJob")
    parser.add_argument("-f", "--follow", action="store_true", help="stream the logs until the job ends")
    parser.add_argument(
        "--attempt", type=_index, metavar="N", help="the workers of this attempt (default: the current one)"
    )
    parser.add_argument("--worker", type=_index, metavar="I", help="only the worker with this index")
    parser.add_argument("--tail", type=int, metavar="N", help="only the last N lines of each worker (default: all)")
    parser.add_argument("--since", type=_duration, metavar="DURATION", help="only lines newer than this (10m, 1h)")
    parser.add_argument("--timestamps", action="store_true", help="begin each line with its time (RFC 3339)")
    parser.add_argument("-c", "--container", help="container to read (default: the trainer container the job names)")
    parser.add_argument(
        "--prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="begin each line with its worker, as [worker-0] (default: on)",
    )
    connection.add_options(parser)
    parser.set_defaults(func=_run)
