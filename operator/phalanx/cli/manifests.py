"""Reading manifests as kubectl does: files or ``-`` (stdin), several YAML documents each, and the
items of a ``kind: List`` (what ``kubectl get -o yaml`` prints) each on its own."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml


class ManifestError(ValueError):
    """A file that cannot be read or is not YAML."""


@dataclass(frozen=True)
class Document:
    """One object of a manifest file, and where it is (``jobs.yaml document 2 item 0``)."""

    where: str
    body: Any
    """The parsed document: an object, or whatever else the file holds (callers say so)."""

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", "")) if isinstance(self.body, dict) else ""

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", "")) if isinstance(self.body, dict) else ""


def read_file(path: str, stdin: TextIO | None = None) -> Iterator[Document]:
    """Every document of one file (``-``: stdin); ManifestError when it cannot be read or parsed."""
    origin = "stdin" if path == "-" else path
    try:
        text = (stdin or sys.stdin).read() if path == "-" else Path(path).read_text(encoding="utf-8")
        loaded = list(yaml.safe_load_all(text))
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{origin}: cannot read: {getattr(error, 'strerror', None) or error}") from error
    except yaml.YAMLError as error:
        raise ManifestError(f"{origin}: not YAML: {error}") from error
    for number, value in enumerate(loaded, start=1):
        where = f"{origin} document {number}"
        if isinstance(value, dict) and str(value.get("kind", "")).endswith("List") and "items" in value:
            for index, item in enumerate(value.get("items") or []):
                yield Document(f"{where} item {index}", item)
        elif value is not None:
            yield Document(where, value)
