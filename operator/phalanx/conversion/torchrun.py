"""Reading a container's command line as a torchrun invocation.

torchrun takes every option from ``PET_<OPTION>`` unless the command line gives it, and the
command line wins. Converting a job from another operator therefore needs to know whether the
container runs torchrun at all, and which options it passes that phalanx sets through PET_*.
The option table follows ``torch.distributed.run`` (and ``torch.distributed.launch``, which adds
``--use-env``); both spellings, ``--rdzv_backend`` and ``--rdzv-backend``, are one option.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
# Python's own options that take a value (python -X dev -m torch.distributed.run ...).
PYTHON_VALUE_OPTIONS = frozenset({"-X", "-W", "-Q"})

# Options without a value (argparse nargs=0).
FLAG_OPTIONS = frozenset({"standalone", "module", "no-python", "run-path", "virtual-local-rank", "use-env"})
VALUE_OPTIONS = frozenset(
    {
        "nnodes",
        "nproc-per-node",
        "rdzv-backend",
        "rdzv-endpoint",
        "rdzv-id",
        "rdzv-conf",
        "max-restarts",
        "monitor-interval",
        "start-method",
        "event-log-handler",
        "role",
        "log-dir",
        "redirects",
        "tee",
        "local-ranks-filter",
        "duplicate-stdout-filters",
        "duplicate-stderr-filters",
        "node-rank",
        "master-addr",
        "master-port",
        "local-addr",
        "logs-specs",
        "numa-binding",
        "signals-to-handle",
        "shutdown-timeout",
    }
)
SHORT_OPTIONS = {"-m": "module", "-r": "redirects", "-t": "tee"}

InvocationKind = Literal["torchrun", "shell", "other"]


@dataclass(frozen=True)
class Option:
    """One torchrun option as written on the command line."""

    name: str
    """Canonical name, dashes only: ``rdzv-endpoint`` for ``--rdzv_endpoint``."""

    value: str | None
    """Its value; None for a flag."""

    index: int
    """Position of its first token in the command line (command then args); -1 inside a shell script."""

    length: int
    """Tokens it takes: 2 for ``--nnodes 2``, 1 for ``--nnodes=2`` and for flags."""

    text: str
    """As written, for messages: ``--nnodes 2``."""


@dataclass(frozen=True)
class Invocation:
    """What a command line runs, as far as torchrun is concerned."""

    kind: InvocationKind
    """torchrun: the command is torchrun (or python -m torch.distributed.run/launch) itself.
    shell: a shell script (sh -c) that runs torchrun somewhere. other: no torchrun found."""

    options: tuple[Option, ...] = ()
    """torchrun's options before the training script."""

    unknown_option: str | None = None
    """An option before the script that torchrun does not have (reading stopped there)."""

    unknown_index: int = -1
    """Its position in the command line; -1 inside a shell script."""


def canonical(option: str) -> str:
    """``--rdzv_endpoint`` and ``--rdzv-endpoint`` are one option."""
    return option.lstrip("-").replace("_", "-")


def _launcher_start(tokens: Sequence[str]) -> int | None:
    """Index of the first torchrun option when ``tokens`` start torchrun, else None."""
    position = 0
    if tokens and posixpath.basename(tokens[0]) == "env":  # env VAR=value ... torchrun
        position = 1
        while position < len(tokens) and "=" in tokens[position] and not tokens[position].startswith("-"):
            position += 1
    if position >= len(tokens):
        return None
    program = posixpath.basename(tokens[position])
    if program == "torchrun":
        return position + 1
    if not PYTHON.match(program):
        return None
    position += 1
    while position < len(tokens):
        token = tokens[position]
        if token == "-m":
            module = tokens[position + 1] if position + 1 < len(tokens) else ""
            return position + 2 if module in LAUNCHER_MODULES else None
        if token.startswith("-m") and token[2:] in LAUNCHER_MODULES:
            return position + 1
        if token in PYTHON_VALUE_OPTIONS:
            position += 2
        elif token.startswith("-") and token != "-":
            position += 1
        else:
            return None  # python runs a script (or -c code): not torchrun
    return None


def _read_options(tokens: Sequence[str], start: int, *, in_shell: bool) -> tuple[list[Option], int | None]:
    """torchrun's options from ``start`` up to the training script."""
    options: list[Option] = []
    position = start
    while position < len(tokens):
        token = tokens[position]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        index = -1 if in_shell else position
        if token in SHORT_OPTIONS or (token[:2] in SHORT_OPTIONS and not token.startswith("--")):
            name = SHORT_OPTIONS[token[:2]]
            if name in FLAG_OPTIONS:
                options.append(Option(name, None, index, 1, token))
                position += 1
            elif len(token) > 2:  # -r3
                options.append(Option(name, token[2:], index, 1, token))
                position += 1
            else:
                value = tokens[position + 1] if position + 1 < len(tokens) else ""
                options.append(Option(name, value, index, 2, f"{token} {value}"))
                position += 2
            continue
        written, equals, attached = token.partition("=")
        name = canonical(written)
        if not token.startswith("--") or (name not in FLAG_OPTIONS and name not in VALUE_OPTIONS):
            return options, position
        if name in FLAG_OPTIONS:
            options.append(Option(name, None, index, 1, token))
            position += 1
        elif equals:
            options.append(Option(name, attached, index, 1, token))
            position += 1
        else:
            value = tokens[position + 1] if position + 1 < len(tokens) else ""
            options.append(Option(name, value, index, 2, f"{token} {value}"))
            position += 2
    return options, None


def _shell_script(tokens: Sequence[str]) -> str | None:
    """The script of ``sh -c SCRIPT`` (also ``bash -lc``, ``sh -ec``), else None."""
    if not tokens or posixpath.basename(tokens[0]) not in SHELLS:
        return None
    for position, token in enumerate(tokens[1:], start=1):
        if token.startswith("-") and not token.startswith("--") and "c" in token[1:]:
            return tokens[position + 1] if position + 1 < len(tokens) else None
        if not token.startswith("-"):
            return None
    return None


def _shell_words(script: str) -> list[str]:
    """The script's words; ``&&``, ``;`` and ``|`` are words of their own, so they end a command."""
    # A newline ends a command as ';' does; a backslash before it continues the line.
    script = script.replace("\\\n", " ").replace("\n", " ; ")
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")  # not (): $(VAR) stays one word
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: read it word by word instead
        return script.split()


def read(tokens: Sequence[str]) -> Invocation:
    """What the command line ``tokens`` (the container's command followed by its args) runs."""
    start = _launcher_start(tokens)
    if start is not None:
        direct, stopped_at = _read_options(tokens, start, in_shell=False)
        if stopped_at is None:
            return Invocation("torchrun", tuple(direct))
        return Invocation("torchrun", tuple(direct), tokens[stopped_at], stopped_at)
    script = _shell_script(tokens)
    if script is None:
        return Invocation("other")
    words = _shell_words(script)
    found: list[Option] = []
    seen_torchrun = False
    unknown: str | None = None
    for position in range(len(words)):
        launcher = _launcher_start(words[position:])
        if launcher is None:
            continue
        seen_torchrun = True
        options, stopped = _read_options(words, position + launcher, in_shell=True)
        found.extend(options)
        if stopped is not None and unknown is None:
            unknown = words[stopped]
    if not seen_torchrun:
        return Invocation("other")
    return Invocation("shell", tuple(found), unknown)
