"""Admission offline: what the API server does with a TrainingJob before storing it, without one.

The same steps, in the same order, with the same words as kube-apiserver 1.34 (apiextensions)
and kubectl: strict decoding refuses fields the schema does not know (outside the pod template,
whose unknown fields are kept); nulls in non-nullable fields are dropped and schema defaults
applied; ``metadata`` is checked as any object's is; the OpenAPI schema is checked; then every
``x-kubernetes-validations`` CEL rule, unless a schema error blocks them (a wrong type, a missing
required field, an unsupported value, too long or too many), which the API server reports with
one more line. Transition rules (``oldSelf``) run only when the stored object is given. Rules see
the whole value, the fields x-kubernetes-preserve-unknown-fields keeps included, as the API
server's do (the template's ``self == oldSelf`` refuses an env edit too; the integration tier checks it).

``phalanx plan`` prints these refusals exactly as ``kubectl create`` would; the integration tier
compares them with the real API server's, case by case.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from phalanx.api import crd
from phalanx.api import v1alpha1 as api

Schema = dict[str, Any]

# ObjectMeta's JSON fields: metadata is decoded into that Go type, so anything else is unknown.
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_1123_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    r"'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
UNCHECKED_RULES = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
# Schema errors after which the API server evaluates no CEL rule (apiextensions' hasBlockingErr).
BLOCKING = frozenset({"Required value", "Unsupported value", "Too long", "Too many", "Type"})


def _go_value(value: Any) -> str:
    """A value as Go's field errors print it: strings quoted, numbers bare, null as null."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


@dataclass(frozen=True)
class FieldError:
    """One refusal, as the API server words it (``field.Error``)."""

    path: str
    """The field, e.g. ``spec.workers.max``; ``<nil>`` for the object as a whole."""
    kind: str
    """Invalid value, Required value, Unsupported value, Too long, Too many (Type for a wrong type,
    which the API server prints as Invalid value)."""
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


def _invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, "Invalid value", f"Invalid value: {_go_value(value)}: {detail}")


@dataclass(frozen=True)
class Verdict:
    """What the API server answers to a create (or, with ``old``, an update)."""

    name: str
    admitted: dict[str, Any] | None = None
    """The object as it would be stored (defaults applied), when accepted."""
    errors: tuple[FieldError, ...] = ()
    unknown_fields: tuple[str, ...] = ()
    """Fields strict decoding refuses (kubectl's default field validation)."""
    version: str = api.VERSION

    @property
    def accepted(self) -> bool:
        return self.admitted is not None

    @property
    def message(self) -> str:
        """The refusal as ``kubectl create`` prints it ('' when accepted)."""
        if self.unknown_fields:
            unknown = ", ".join(f'unknown field "{path}"' for path in self.unknown_fields)
            return (
                f'{api.KIND} in version "{self.version}" cannot be handled as a {api.KIND}: '
                f"strict decoding error: {unknown}"
            )
        if not self.errors:
            return ""
        head = f'The {api.KIND} "{self.name}" is invalid: '
        if len(self.errors) == 1:
            return head + str(self.errors[0])
        return head + "\n" + "\n".join(f"* {error}" for error in self.errors)


@cache
def schema() -> Schema:
    """The object's OpenAPI schema, as the CRD carries it."""
    return crd.trainingjob_schema()


# -- strict decoding, pruning of nulls, defaulting ------------------------------------------------


def _unknown(node: Schema, value: Any, path: str) -> Iterator[str]:
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = node.get("properties")
        if isinstance(node.get("additionalProperties"), dict):
            for key, item in value.items():
                yield from _unknown(node["additionalProperties"], item, f"{path}.{key}")
            return
        for key, item in value.items():
            if properties is not None and key in properties:
                yield from _unknown(properties[key], item, f"{path}.{key}")
            elif not (path == "" and key in ("apiVersion", "kind")):
                yield f"{path}.{key}".lstrip(".")
    elif isinstance(value, list) and "items" in node:
        for index, item in enumerate(value):
            yield from _unknown(node["items"], item, f"{path}[{index}]")


def unknown_fields(body: dict[str, Any]) -> list[str]:
    """Fields the schema does not know, in kubectl's order (sorted)."""
    found = list(_unknown(schema(), {k: v for k, v in body.items() if k != "metadata"}, ""))
    found += [f"metadata.{key}" for key in (body.get("metadata") or {}) if key not in OBJECT_META_FIELDS]
    return sorted(found)


def _drop_nulls(node: Schema, value: Any) -> Any:
    """Nulls in fields that are not nullable are dropped before defaulting, as the API server does."""
    if isinstance(value, dict):
        properties = node.get("properties", {})
        extra = node.get("additionalProperties")
        kept = {}
        for key, item in value.items():
            sub = properties.get(key, extra if isinstance(extra, dict) else {})
            if item is None and not sub.get("nullable"):
                continue
            kept[key] = _drop_nulls(sub, item)
        return kept
    if isinstance(value, list) and "items" in node:
        return [_drop_nulls(node["items"], item) for item in value]
    return value


def apply_defaults(node: Schema, value: Any) -> Any:
    """Fill defaults of absent properties, recursively (structural defaulting)."""
    if isinstance(value, list) and "items" in node:
        return [apply_defaults(node["items"], item) for item in value]
    if not isinstance(value, dict) or node.get("type") != "object":
        return value
    result = dict(value)
    for name, sub in node.get("properties", {}).items():
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(sub["default"])
        if name in result:
            result[name] = apply_defaults(sub, result[name])
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        result = {key: apply_defaults(extra, item) for key, item in result.items()}
    return result


def defaulted(body: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it (nulls dropped, defaults applied)."""
    result: dict[str, Any] = apply_defaults(schema(), _drop_nulls(schema(), body))
    return result


# -- metadata and the OpenAPI schema ------------------------------------------------------------


def _metadata_errors(metadata: dict[str, Any]) -> list[FieldError]:
    errors: list[FieldError] = []
    name = metadata.get("name")
    if not name and not metadata.get("generateName"):
        errors.append(FieldError("metadata.name", "Required value", "Required value: name or generateName is required"))
    elif isinstance(name, str) and name and not DNS_1123_SUBDOMAIN.match(name):
        errors.append(_invalid("metadata.name", name, DNS_1123_SUBDOMAIN_MESSAGE))
    namespace = metadata.get("namespace")
    if isinstance(namespace, str) and namespace and not DNS_1123_LABEL.match(namespace):
        errors.append(_invalid("metadata.namespace", namespace, DNS_1123_LABEL_MESSAGE))
    return errors


def _type_ok(expected: str, value: Any) -> bool:
    actual = _json_type(value)
    return actual == expected or (expected == "number" and actual == "integer")


def _schema_errors(node: Schema, value: Any, path: str) -> Iterator[FieldError]:
    """kube-openapi's checks of one node, in its order: type, then the keyword checks, then children."""
    expected = node.get("type")
    if expected and not _type_ok(expected, value):
        kind = _json_type(value)
        yield FieldError(
            path,
            "Type",
            f"Invalid value: {_go_value(kind)}: {path} in body must be of type {expected}: {_go_value(kind)}",
        )
        if "enum" in node and value not in node["enum"]:
            yield _unsupported(path, value, node["enum"])
        return
    if "enum" in node and value not in node["enum"]:
        yield _unsupported(path, value, node["enum"])
    if isinstance(value, str):  # the first failing check only, as kube-openapi's string validator
        if "maxLength" in node and len(value.encode()) > node["maxLength"]:
            yield FieldError(path, "Too long", f"Too long: may not be more than {node['maxLength']} bytes")
        elif "minLength" in node and len(value) < node["minLength"]:
            yield _invalid(path, value, f"{path} in body should be at least {node['minLength']} chars long")
        elif "pattern" in node and not re.search(node["pattern"], value):
            yield _invalid(path, value, f"{path} in body should match '{node['pattern']}'")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "maximum" in node and value > node["maximum"]:
            yield _invalid(path, value, f"{path} in body should be less than or equal to {node['maximum']}")
        if "minimum" in node and value < node["minimum"]:
            yield _invalid(path, value, f"{path} in body should be greater than or equal to {node['minimum']}")
    if isinstance(value, list):
        if "maxItems" in node and len(value) > node["maxItems"]:
            yield FieldError(path, "Too many", f"Too many: {len(value)}: must have at most {node['maxItems']} items")
        if "minItems" in node and len(value) < node["minItems"]:
            yield _invalid(path, len(value), f"{path} in body should have at least {node['minItems']} items")
        for index, item in enumerate(value):
            yield from _schema_errors(node.get("items", {}), item, f"{path}[{index}]")
    if isinstance(value, dict):
        if "maxProperties" in node and len(value) > node["maxProperties"]:
            yield FieldError(
                path, "Too many", f"Too many: {len(value)}: must have at most {node['maxProperties']} items"
            )
        for name in node.get("required", []):
            if name not in value:
                yield FieldError(f"{path}.{name}", "Required value", "Required value")
        properties = node.get("properties", {})
        extra = node.get("additionalProperties")
        for name, item in value.items():
            if name in properties:
                yield from _schema_errors(properties[name], item, f"{path}.{name}")
            elif isinstance(extra, dict):
                yield from _schema_errors(extra, item, f"{path}.{name}")


def _unsupported(path: str, value: Any, allowed: list[Any]) -> FieldError:
    values = ", ".join(_go_value(option) for option in allowed)
    return FieldError(path, "Unsupported value", f"Unsupported value: {_go_value(value)}: supported values: {values}")


# -- CEL rules ----------------------------------------------------------------------------------


_CEL = celpy.Environment()


@cache
def _program(expression: str) -> Any:
    return _CEL.program(_CEL.compile(expression))


def _cel_errors(node: Schema, value: Any, old: Any, path: str) -> Iterator[FieldError]:
    for rule in node.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue  # transition rules apply to updates only
        activation = {"self": json_to_cel(value)}
        if transition:
            activation["oldSelf"] = json_to_cel(old)
        where = path + rule.get("fieldPath", "")
        outcome = _program(rule["rule"]).evaluate(activation)
        if isinstance(outcome, CELEvalError):
            yield _invalid(where, _json_type(value), f"rule evaluation error: {outcome}")
            continue
        if outcome:
            continue
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        if "messageExpression" in rule:
            message = str(_program(rule["messageExpression"]).evaluate(activation))
        yield _invalid(where, _json_type(value), message)
    if isinstance(value, dict):
        properties = node.get("properties", {})
        for name, item in value.items():
            if name in properties:
                old_item = old.get(name) if isinstance(old, dict) else None
                yield from _cel_errors(properties[name], item, old_item, f"{path}.{name}")
    elif isinstance(value, list) and "items" in node:
        for index, item in enumerate(value):
            yield from _cel_errors(node["items"], item, None, f"{path}[{index}]")


# -- the whole -------------------------------------------------------------------------------------


@dataclass
class _Checks:
    errors: list[FieldError] = field(default_factory=list)

    def blocking(self) -> bool:
        return any(error.kind in BLOCKING for error in self.errors)


def admit(body: dict[str, Any], old: dict[str, Any] | None = None) -> Verdict:
    """What the API server answers to creating ``body`` (updating ``old`` to it, when given)."""
    metadata = body.get("metadata") or {}
    name = str(metadata.get("name") or metadata.get("generateName") or "")
    version = str(body.get("apiVersion", api.API_VERSION)).rpartition("/")[2]
    unknown = unknown_fields(body)
    if unknown:
        return Verdict(name, unknown_fields=tuple(unknown), version=version)
    # Status belongs to the status subresource: a create or an update of the object ignores it.
    stored = defaulted({key: value for key, value in body.items() if key != "status"})
    previous = defaulted({key: value for key, value in old.items() if key != "status"}) if old is not None else None
    checks = _Checks(_metadata_errors(stored.get("metadata") or {}))
    top = schema()
    for key in ("metadata", "spec"):
        if key in stored:
            checks.errors.extend(_schema_errors(top["properties"][key], stored[key], key))
        elif key in top.get("required", []):
            checks.errors.append(FieldError(key, "Required value", "Required value"))
    if checks.blocking():
        checks.errors.append(FieldError("<nil>", "Invalid value", f"Invalid value: null: {UNCHECKED_RULES}"))
    elif "spec" in stored:
        old_spec = previous.get("spec") if previous is not None else None
        checks.errors.extend(_cel_errors(top["properties"]["spec"], stored["spec"], old_spec, "spec"))
    if checks.errors:
        return Verdict(name, errors=tuple(checks.errors), version=version)
    return Verdict(name, admitted=stored, version=version)
