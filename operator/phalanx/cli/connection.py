"""What the commands that read a cluster (``describe``, ``logs``) share: the kubeconfig, context
and namespace options, a client made from them, and how they end: an error is one line on stderr
and exit status 1, Ctrl-C ends quietly with 130 (as a shell reports kubectl killed by SIGINT)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client (aiohttp, kubernetes) is imported when a command runs, not for --help
    from phalanx.cluster.client import ApiClient

INTERRUPTED = 130  # 128 + SIGINT
BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of our output went away (`| head`)


class CommandError(Exception):
    """A failure the user can act on, said in one line."""


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--kubeconfig``, ``--context`` and ``-n/--namespace``, as kubectl spells them."""
    parser.add_argument(
        "--kubeconfig",
        help="kubeconfig file(s) to use (default: $KUBECONFIG, else ~/.kube/config; in a pod its service account)",
    )
    parser.add_argument("--context", help="kubeconfig context to use (default: the current context)")
    parser.add_argument(
        "-n",
        "--namespace",
        help="the job's namespace (default: the context's namespace, in a pod its own, else default)",
    )
    parser.set_defaults(prog=parser.prog)


@dataclass(frozen=True)
class Connection:
    client: ApiClient
    namespace: str


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace) -> AsyncIterator[Connection]:
    """A client logged in as kubectl would be with the same options, and the namespace to use."""
    from phalanx.cluster.client import ApiClient
    from phalanx.cluster.login import Login

    login = Login(kubeconfig=args.kubeconfig, context=args.context)
    try:
        namespace = args.namespace or login.namespace()
        credentials = await asyncio.to_thread(login.load)  # an exec plugin may take seconds
        async with ApiClient(credentials, login=login) as client:
            yield Connection(client, namespace)
    finally:
        login.close()


async def get_job(connection: Connection, name: str) -> dict[str, Any]:
    """The TrainingJob, or a CommandError that says why not."""
    from phalanx.api import v1alpha1 as api
    from phalanx.cluster.client import ApiError

    try:
        return await connection.client.get(api.API_VERSION, api.KIND, connection.namespace, name, plural=api.PLURAL)
    except ApiError as error:
        if error.status == 404 and "could not find the requested resource" in error.message:
            served = f"{api.PLURAL}.{api.GROUP}"
            raise CommandError(f"the cluster does not serve {served}: is phalanx's CRD installed?") from None
        if error.status == 404:
            raise CommandError(f'trainingjob "{name}" not found in namespace "{connection.namespace}"') from None
        raise


def execute(args: argparse.Namespace, command: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a command's coroutine to its exit status; failures become one line on stderr."""
    from phalanx.cluster.client import TRANSPORT_ERRORS, ApiError
    from phalanx.cluster.login import LoginError

    prog = getattr(args, "prog", "phalanx")
    try:
        return asyncio.run(command())
    except KeyboardInterrupt:
        return INTERRUPTED
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except (CommandError, LoginError) as error:
        message = str(error)
    except ApiError as error:
        message = f"{error.message} ({error.status} {error.reason})" if error.message else str(error)
    except TRANSPORT_ERRORS as error:
        message = f"cannot reach the API server: {error or type(error).__name__}"
    print(f"{prog}: {message}", file=sys.stderr)
    return 1
