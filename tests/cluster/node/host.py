"""This host, as the real-node tier uses it: cache directories, processes, networking facts."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

T = TypeVar("T")

# a command-line argument: run() and HostProcess pass each through str()
Arg = str | os.PathLike[str]

NODE_DIR = Path(__file__).resolve().parent
REPO_ROOT = NODE_DIR.parents[2]


def cache_dir() -> Path:
    """``${PHALANX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/phalanx}``."""
    env = os.environ.get("PHALANX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "phalanx"


def node_cache_dir() -> Path:
    d = cache_dir() / "node"
    d.mkdir(parents=True, exist_ok=True)
    return d


@overload
def run(
    cmd: Sequence[Arg],
    *,
    check: bool = ...,
    capture: bool = ...,
    input: str | None = ...,
    env: Mapping[str, str] | None = ...,
    timeout: float | None = ...,
) -> subprocess.CompletedProcess[str]: ...


@overload
def run(
    cmd: Sequence[Arg],
    *,
    check: bool = ...,
    capture: bool = ...,
    input: bytes,
    env: Mapping[str, str] | None = ...,
    timeout: float | None = ...,
) -> subprocess.CompletedProcess[bytes]: ...


def run(
    cmd: Sequence[Arg],
    *,
    check: bool = True,
    capture: bool = True,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[Any]:
    """Run a command; on failure raise with its stderr in the message."""
    text = not isinstance(input, bytes)
    proc = subprocess.run(
        list(map(str, cmd)),
        capture_output=capture,
        text=text,
        input=input,
        env=None if env is None else {**os.environ, **env},
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        err = proc.stderr if capture else ""
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{err}")
    return proc


def hash_inputs(*parts: str | bytes | Path) -> str:
    """sha256 over strings/bytes/files (file contents, not paths)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            h.update(part.read_bytes())
        elif isinstance(part, str):
            h.update(part.encode())
        else:
            h.update(part)
        h.update(b"\0")
    return h.hexdigest()


def host_ip() -> str:
    """The host's primary IPv4 address (source of the default route)."""
    out = run(["ip", "-4", "-o", "route", "get", "1.1.1.1"]).stdout.split()
    return out[out.index("src") + 1]


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.5, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else "")
    )


class HostProcess:
    """A long-running host process in its own process group, PID recorded in a file."""

    def __init__(
        self, name: str, argv: Sequence[Arg], log_dir: Path, pid_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_dir) / f"{name}.log"
        self.pid_path = Path(pid_dir) / f"{name}.pid"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, pass_fds: tuple[int, ...] = ()) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=pass_fds,
                env=None if self.env is None else {**os.environ, **self.env},
            )
        finally:
            log.close()
        self.pid_path.write_text(f"{self.proc.pid}\n")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else read_pid(self.pid_path)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        pid = self.pid
        return pid is not None and pid_alive(pid)

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited early; last log lines:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def stop(self, timeout: float = 15.0) -> None:
        pid = self.pid
        if pid is not None:
            stop_pid(pid, timeout=timeout, group=True)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
        self.pid_path.unlink(missing_ok=True)


def read_pid(path: Path) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    try:  # a zombie child of ours counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_pid(pid: int, timeout: float = 15.0, group: bool = True) -> None:
    """SIGTERM the process (and its process group if it leads one), then SIGKILL."""

    def send(sig: int) -> None:
        try:
            if group and os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    if not pid_alive(pid):
        return
    send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    send(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)


def stop_pidfile(path: Path) -> None:
    """Stop the process recorded in ``path`` if it still is the program the file is named after
    (``kubelet.pid`` -> argv[0] ends with ``kubelet``; a recycled PID is left alone); remove it."""
    path = Path(path)
    pid = read_pid(path)
    if pid is not None:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            argv0 = ""
        if argv0 and Path(argv0).name == path.stem:
            stop_pid(pid)
    path.unlink(missing_ok=True)


def stop_pidfiles(paths: Iterable[Path]) -> None:
    """Stop processes left behind by an earlier run (pid files in a state dir)."""
    for p in paths:
        stop_pidfile(Path(p))
