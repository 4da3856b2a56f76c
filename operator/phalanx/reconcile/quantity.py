"""Kubernetes resource quantities, as far as the planner needs them."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10,
    "Mi": Decimal(2) ** 20,
    "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50,
    "Ei": Decimal(2) ** 60,
}
_PATTERN = re.compile(r"^([+]?[0-9]*\.?[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity."""


def parse_quantity(value: str | int | float) -> Decimal:
    """Parse "500m", "2", "1.5", "64Gi" into a Decimal of base units."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _PATTERN.match(value.strip())
    if match is None:
        raise QuantityError(f"{value!r} is not a quantity")
    try:
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation as error:  # pragma: no cover - the pattern admits only numbers
        raise QuantityError(f"{value!r} is not a quantity") from error


def format_quantity(value: Decimal) -> str:
    """Format base units canonically: whole numbers plainly, fractions in milli-units."""
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value())}m"
