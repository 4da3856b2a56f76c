"""Reading manifests as kubectl does: files or ``-`` (stdin), several YAML documents each, and
``kind: List`` flattened."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


class ManifestError(ValueError):
    """A file that cannot be read or is not YAML."""


@dataclass(frozen=True)
class Document:
    """One object of a manifest file, and where it came from (for messages)."""

    source: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", ""))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", ""))

    def describe(self) -> str:
        return f"{self.source}: {self.kind or 'object'} {self.name or '(no name)'}"


def _flatten(source: str, value: Any) -> Iterator[Document]:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ManifestError(f"{source}: a document is not an object")
    if value.get("kind") == "List" or (value.get("kind", "").endswith("List") and "items" in value):
        for item in value.get("items") or []:
            yield from _flatten(source, item)
        return
    yield Document(source, value)


def read_documents(paths: list[str]) -> Iterator[Document]:
    """Every object in ``paths`` (``-`` is stdin), in order."""
    for path in paths:
        source = "<stdin>" if path == "-" else path
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text()
            loaded = list(yaml.safe_load_all(text))
        except OSError as error:
            raise ManifestError(f"{source}: {error.strerror or error}") from error
        except yaml.YAMLError as error:
            raise ManifestError(f"{source}: not YAML: {error}") from error
        for value in loaded:
            yield from _flatten(source, value)
