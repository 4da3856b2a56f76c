"""Errors the planner reports instead of crashing."""

from __future__ import annotations


class PlanningError(ValueError):
    """A spec that passed the schema but cannot be turned into pods.

    It names the field and the reason; the job becomes Failed with reason ``InvalidSpec``
    and this message, instead of a handler that retries forever.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
