"""What the SDK raises: every failure is a ``PhalanxError``; no exception of the Kubernetes client
(``ApiError``, aiohttp's, the login package's) reaches the user. ``translated`` maps them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from phalanx.cli.connection import CommandError
from phalanx.cluster.client import TRANSPORT_ERRORS, ApiError
from phalanx.cluster.login import LoginError


class PhalanxError(Exception):
    """Base of every error the SDK raises."""


class SpecRefused(PhalanxError):
    """The API server (or, for ``plan``, offline admission) refused the job; the message is its
    words, the same ``phalanx plan`` prints."""


class JobNotFound(PhalanxError):
    """No TrainingJob of that name in the namespace (or it was deleted while waited for)."""


class JobExists(PhalanxError):
    """A different TrainingJob already has the name."""


class JobFailed(PhalanxError):
    """The job failed; ``reason`` and ``message`` are its status's."""

    def __init__(self, name: str, reason: str, message: str) -> None:
        super().__init__(f"trainingjob {name} failed ({reason or 'no reason given'}): {message}".rstrip(": "))
        self.name = name
        self.reason = reason
        self.message = message


class WaitTimeout(PhalanxError, TimeoutError):
    """``wait`` gave up before the job reached the phase."""


class ConnectionFailed(PhalanxError):
    """The API server cannot be reached, or answered with an error the SDK has no better name for."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LoginFailed(PhalanxError):
    """No usable credentials: the kubeconfig, its exec plugin or the service account failed, or the
    API server refused them (401, 403)."""


class CodeRefused(PhalanxError, ValueError):
    """``submit_function`` or ``submit_script`` cannot ship this code or these arguments."""


@contextlib.contextmanager
def translated(what: str, *, missing: str | None = None) -> Iterator[None]:
    """Raise the SDK's error for the client's, saying ``what`` was being done; a 404 of the object
    itself is ``JobNotFound(missing)`` when ``missing`` is given."""
    try:
        yield
    except PhalanxError:
        raise
    except LoginError as error:
        raise LoginFailed(str(error)) from None
    except CommandError as error:  # a log stream's refusal, in one line
        raise ConnectionFailed(f"{what}: {error}") from None
    except ApiError as error:
        words = refusal_words(error.reason, error.message or str(error), error.details)
        raise api_failure(what, error.status, error.reason, words, missing) from None
    except TRANSPORT_ERRORS as error:
        raise ConnectionFailed(f"{what}: cannot reach the API server: {str(error) or type(error).__name__}") from None


def refusal_words(reason: str, message: str, details: Mapping[str, Any]) -> str:
    """A refusal as kubectl prints it (and ``phalanx plan``): an Invalid one from its causes, one
    per line when there are several; anything else as the server's message."""
    causes = details.get("causes") if reason == "Invalid" else None
    if not isinstance(causes, list) or not causes:
        return message
    head = "The request is invalid"
    if details.get("kind") or details.get("name"):
        head = f'The {details.get("kind", "")} "{details.get("name", "")}" is invalid'
    lines: list[str] = []
    for cause in causes:
        line = f"{cause.get('field', '')}: {cause.get('message', '')}" if isinstance(cause, Mapping) else str(cause)
        if line not in lines:  # kubectl skips repeated causes
            lines.append(line)
    if len(lines) == 1:
        return f"{head}: {lines[0]}"
    return f"{head}: \n" + "\n".join(f"* {line}" for line in lines)


def api_failure(what: str, status: int, reason: str, words: str, missing: str | None = None) -> PhalanxError:
    """The SDK's error for an API server's refusal (status, reason, its message)."""
    if status == 404 and "could not find the requested resource" in words:
        return ConnectionFailed(
            f"{what}: the cluster does not serve trainingjobs.phalanx.dev: is phalanx's CRD installed?", status
        )
    if status == 404 and missing is not None:
        return JobNotFound(missing)
    if status in (401, 403):
        return LoginFailed(f"{what}: {words}")
    if status in (400, 422):
        return SpecRefused(words)
    return ConnectionFailed(f"{what}: {words} ({status} {reason})", status)
