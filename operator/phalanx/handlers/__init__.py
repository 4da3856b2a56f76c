"""kopf glue. ``kopf run -m phalanx.handlers`` (or ``phalanx run``) registers everything here."""

from phalanx.handlers import children, lifecycle, trainingjob

__all__ = ["children", "lifecycle", "trainingjob"]
