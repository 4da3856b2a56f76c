"""Validate objects against the generated CRD offline, the way the API server does.

Three steps, as in kube-apiserver: apply schema defaults, check the OpenAPI schema,
evaluate every ``x-kubernetes-validations`` CEL rule (transition rules only when an old
object is given). The integration tier repeats the important cases against the real
API server; this module lets the unit tier test every rule in milliseconds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

from phalanx.api import crd

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


@dataclass(frozen=True)
class Violation:
    """One refusal: where and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def _program(expression: str) -> Any:
    if expression not in _PROGRAMS:
        _PROGRAMS[expression] = _ENV.program(_ENV.compile(expression))
    return _PROGRAMS[expression]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill defaults of absent properties, recursively (structural defaulting)."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], item) for item in value]
        return value
    result = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(sub["default"])
        if name in result:
            result[name] = apply_defaults(sub, result[name])
    return result


def _cel_violations(schema: dict[str, Any], value: Any, old: Any, path: str) -> list[Violation]:
    found: list[Violation] = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = "oldSelf" in rule["rule"]
        if uses_old and old is None:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if uses_old:
            activation["oldSelf"] = celpy.json_to_cel(old)
        outcome = _program(rule["rule"]).evaluate(activation)
        if isinstance(outcome, celpy.CELEvalError):
            raise AssertionError(f"rule {rule['rule']!r} failed to evaluate at {path}: {outcome}")
        if not outcome:
            message = rule.get("message")
            if "messageExpression" in rule:
                message = str(_program(rule["messageExpression"]).evaluate({"self": celpy.json_to_cel(value)}))
            where = path + rule.get("fieldPath", "")
            found.append(Violation(where, message or f"failed rule: {rule['rule']}"))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                old_sub = old.get(name) if isinstance(old, dict) else None
                found.extend(_cel_violations(sub, value[name], old_sub, f"{path}.{name}"))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found.extend(_cel_violations(schema["items"], item, None, f"{path}[{index}]"))
    return found


def _unknown_fields(schema: dict[str, Any], value: Any, path: str) -> list[Violation]:
    """Strict field validation (kubectl's default): fields the schema does not know are refused."""
    found: list[Violation] = []
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in value.items():
            if name not in schema["properties"]:
                if not schema.get("x-kubernetes-preserve-unknown-fields") and path:
                    found.append(Violation(f"{path}.{name}", "unknown field"))
            else:
                found.extend(_unknown_fields(schema["properties"][name], sub, f"{path}.{name}"))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            found.extend(_unknown_fields(schema["items"], item, f"{path}[{index}]"))
    return found


def validate(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[Violation]:
    """Every reason the API server would refuse ``obj`` (empty when it would accept it)."""
    schema = crd.trainingjob_schema()
    defaulted = apply_defaults(schema, obj)
    old_defaulted = apply_defaults(schema, old) if old is not None else None
    validator = jsonschema.Draft202012Validator(schema)
    violations = [
        Violation("." + ".".join(str(part) for part in error.absolute_path), error.message)
        for error in validator.iter_errors(defaulted)
    ]
    violations += _unknown_fields(schema["properties"]["spec"], defaulted.get("spec"), ".spec")
    if violations:
        return violations
    return _cel_violations(schema, defaulted, old_defaulted, "")


def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it."""
    result: dict[str, Any] = apply_defaults(crd.trainingjob_schema(), obj)
    return result
