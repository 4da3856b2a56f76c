"""kopf glue. ``kopf run -m phalanx.handlers`` (or ``phalanx run``) registers everything here."""

from phalanx.handlers import lifecycle, trainingjob

__all__ = ["lifecycle", "trainingjob"]
