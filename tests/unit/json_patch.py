"""A small JSON patch (RFC 6902) applier for the unit tests' stand-in API server: add, remove,
replace and test on objects and arrays, with JSON pointer (RFC 6901) unescaping. The patch applies
as a whole or not at all, as the API server's does (it answers 422 when a test fails)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any


class PatchFailedError(Exception):
    """A test failed, or a path does not exist: the API server refuses the patch (422)."""


def tokens(pointer: str) -> list[str]:
    """The reference tokens of a JSON pointer: "~1" is "/", "~0" is "~" (in that order)."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchFailedError(f"not a JSON pointer: {pointer!r}")
    return [token.replace("~1", "/").replace("~0", "~") for token in pointer[1:].split("/")]


def _index(container: list[Any], token: str, *, adding: bool) -> int:
    if adding and token == "-":
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchFailedError(f"not an array index: {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not adding):
        raise PatchFailedError(f"array index {index} out of range")
    return index


def _parent(document: Any, path: str) -> tuple[Any, str]:
    """The container the last token of ``path`` is in, and that token."""
    parts = tokens(path)
    if not parts:
        raise PatchFailedError("the whole document cannot be patched here")
    node = document
    for token in parts[:-1]:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, adding=False)]
        else:
            raise PatchFailedError(f"{path}: {token!r} does not exist")
    return node, parts[-1]


def _get(document: Any, path: str) -> Any:
    node, token = _parent(document, path)
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, adding=False)]
    raise PatchFailedError(f"{path} does not exist")


def _apply_one(document: Any, operation: Mapping[str, Any]) -> None:
    op, path = operation["op"], operation["path"]
    if op == "test":
        if _get(document, path) != operation["value"]:
            raise PatchFailedError(f"test of {path} failed")
        return
    node, token = _parent(document, path)
    if op == "add":
        if isinstance(node, dict):
            node[token] = copy.deepcopy(operation["value"])
        elif isinstance(node, list):
            node.insert(_index(node, token, adding=True), copy.deepcopy(operation["value"]))
        else:
            raise PatchFailedError(f"{path}: the parent is not a container")
    elif op in ("remove", "replace"):
        _get(document, path)  # both need the target to exist
        if isinstance(node, dict):
            if op == "remove":
                del node[token]
            else:
                node[token] = copy.deepcopy(operation["value"])
        else:
            index = _index(node, token, adding=False)
            if op == "remove":
                del node[index]
            else:
                node[index] = copy.deepcopy(operation["value"])
    else:
        raise PatchFailedError(f"unsupported operation {op!r}")


def apply(document: Any, operations: Sequence[Mapping[str, Any]]) -> Any:
    """``document`` with ``operations`` applied, in order (``document`` is left as it was); raises
    PatchFailedError, changing nothing, when one fails."""
    patched = copy.deepcopy(document)
    for operation in operations:
        _apply_one(patched, operation)
    return patched
