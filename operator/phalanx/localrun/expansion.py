"""The kubelet's ``$(VAR)`` expansion of a container's env values, command and args.

A port of Kubernetes' ``third_party/forked/golang/expansion``: ``$(NAME)`` becomes NAME's value
when NAME is defined, and stays as written when it is not; ``$$`` is an escaped ``$``; any other
``$`` is kept with the character after it. An env value sees only the variables defined before it.
"""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, variables: Mapping[str, str]) -> str:
    """``text`` with every ``$(NAME)`` that ``variables`` defines replaced, as the kubelet does."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            following = text[cursor + 1]
            advance = 1
            if following == "$":
                out.append("$")
            elif following == "(":
                closing = text.find(")", cursor + 2)
                if closing == -1:  # an incomplete reference is kept
                    out.append("$(")
                else:
                    name = text[cursor + 2 : closing]
                    out.append(variables.get(name, f"$({name})"))
                    advance = closing - cursor
            else:
                out.append("$" + following)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)
