"""The unit tier's view of admission: ``phalanx.api.admission`` (what the API server would answer)
as a list of violations, each a field path and a message, for the rule-by-rule tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.api import admission


@dataclass(frozen=True)
class Violation:
    """One refusal: where (``.spec.workers.min``) and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[Violation]:
    """Every reason the API server would refuse ``obj`` (empty when it would accept it)."""
    verdict = admission.admit(obj, old)
    found = [Violation(f".{path}", "unknown field") for path in verdict.unknown_fields]
    return found + [Violation(f".{error.path}", error.detail) for error in verdict.errors]


def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it."""
    return admission.defaulted(obj)
