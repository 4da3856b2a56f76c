"""Code shipped in a ConfigMap: a function's source with its arguments (``submit_function``), or a
script or directory (``submit_script``), and the TrainingJob that runs it under torchrun.

The contract (docs/sdk.md, ``phalanx.localrun`` reads it too): the ConfigMap ``<job>-code``
(label ``phalanx.dev/job-name``) is mounted read-only at ``/etc/phalanx/code`` through the volume
``phalanx-code``; the trainer container has ``PHALANX_CODE_DIR`` set to that path and runs
``torchrun $(PHALANX_CODE_DIR)/<entry>``. Pure: no I/O but reading the files to ship.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import math
import os
import re
import secrets
import textwrap
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.sdk.errors import CodeRefused

CODE_VOLUME = "phalanx-code"
CODE_MOUNT_PATH = "/etc/phalanx/code"
CODE_DIR_ENV = "PHALANX_CODE_DIR"
CODE_DIGEST_ANNOTATION = f"{naming.PREFIX}/code-digest"
"""On the ConfigMap and the job: which code, so a repeated submit recognises its own leftovers."""
CONFIG_MAP_LIMIT = 1024 * 1024
"""The API server refuses a ConfigMap whose object is larger (etcd's 1 MiB value limit)."""
SKIPPED_NAMES = frozenset({"__pycache__", ".git", ".ipynb_checkpoints", ".mypy_cache", ".pytest_cache", ".venv"})

FUNCTION_MODULE = "phalanx_function"  # the shipped function's source, as a module
CALL_FILE = "phalanx_call.json"  # its name, arguments and packages
RUNNER_FILE = "phalanx_run.py"  # the entry torchrun runs in every worker
DEFAULT_IMAGE = "phalanx.local/trainer:dev"

# The entry script every worker runs: install packages (local rank 0 installs, the others wait),
# import the function and call it. Runs in the training image, with only the standard library.
RUNNER = '''\
"""Run the function phalanx's SDK shipped (phalanx_call.json) in this torchrun worker."""
import importlib, json, os, subprocess, sys, tempfile, time

CODE_DIR = os.path.dirname(os.path.abspath(__file__))
INSTALL_TIMEOUT_SECONDS = 1800


def install(packages):
    target = os.environ.get("PHALANX_PACKAGES_DIR") or os.path.join(tempfile.gettempdir(), "phalanx-packages")
    marker = os.path.join(target, ".phalanx-installed")
    wanted = json.dumps(packages)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        os.makedirs(target, exist_ok=True)
        if not (os.path.exists(marker) and open(marker).read() == wanted):
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--target", target, *packages]
            subprocess.run(command, check=True)
            with open(marker + ".tmp", "w") as out:
                out.write(wanted)
            os.replace(marker + ".tmp", marker)  # whole or absent: the others never read half of it
    else:
        deadline = time.monotonic() + INSTALL_TIMEOUT_SECONDS
        while not (os.path.exists(marker) and open(marker).read() == wanted):
            if time.monotonic() > deadline:
                raise SystemExit("phalanx: local rank 0 did not install the packages in time")
            time.sleep(1)
    sys.path.insert(0, target)


def main():
    with open(os.path.join(CODE_DIR, "phalanx_call.json")) as source:
        call = json.load(source)
    if call.get("packages"):
        install(call["packages"])
    sys.path.insert(0, CODE_DIR)
    function = getattr(importlib.import_module(call["module"]), call["function"])
    function(*call["args"], **call["kwargs"])


if __name__ == "__main__":
    main()
'''


@dataclass(frozen=True)
class ShippedCode:
    """What goes into the ConfigMap: text files and binary files by relative path, and the entry."""

    files: Mapping[str, str]
    binary: Mapping[str, bytes]
    entry: str
    """Relative path of the script torchrun runs."""

    @property
    def digest(self) -> str:
        hashed = hashlib.sha256()
        for path in sorted({*self.files, *self.binary}):
            data = self.files[path].encode() if path in self.files else self.binary[path]
            hashed.update(f"{path}\0{len(data)}\0".encode() + data)
        return hashed.hexdigest()[:32]


def function_source(fn: Callable[..., Any]) -> str:
    """The source of a module-level function, dedented, preceded by the imports of the modules it
    uses as globals; CodeRefused when it cannot run elsewhere from its source alone."""
    name = getattr(fn, "__name__", repr(fn))
    if not isinstance(fn, types.FunctionType):
        raise CodeRefused(f"{name!s} is not a Python function (def): only functions can be shipped")
    if fn.__name__ == "<lambda>":
        raise CodeRefused("a lambda cannot be shipped: define the function with def, at the top level")
    if "<locals>" in fn.__qualname__ or fn.__closure__:
        raise CodeRefused(
            f"{fn.__qualname__} is defined inside another function: ship a function defined at the top level of a"
            " module or notebook cell (its source is shipped, not the variables it closes over)"
        )
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise CodeRefused(
            f"the source of {fn.__name__} cannot be found (a function typed at a plain python prompt, or from a"
            " compiled module, has none): define it in a file or a notebook cell"
        ) from None
    closure = inspect.getclosurevars(fn)
    imports, others = [], []
    for global_name, value in sorted(closure.globals.items()):
        if global_name == fn.__name__:
            continue  # recursion: the shipped module defines it
        if isinstance(value, types.ModuleType):
            module = value.__name__
            imports.append(f"import {module}" if module == global_name else f"import {module} as {global_name}")
        else:
            others.append(global_name)
    if others:
        raise CodeRefused(
            f"{fn.__name__} uses global names that are not modules: {', '.join(others)}; only its source is"
            " shipped: import or define them inside the function, or pass them as arguments"
        )
    return "\n".join([*imports, "", "", source]) if imports else source


def arguments_json(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as they travel (JSON); CodeRefused for a value JSON cannot carry exactly."""
    for where, value in [*((f"argument {i + 1}", v) for i, v in enumerate(args)), *kwargs.items()]:
        problem = _not_json(value)
        if problem:
            raise CodeRefused(f"{where} cannot be shipped as JSON: {problem}")
    return list(args), dict(kwargs)


def _not_json(value: Any) -> str | None:
    """Why ``value`` does not survive JSON unchanged (None when it does)."""
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, list):
        return next((problem for item in value if (problem := _not_json(item))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"a dict key {key!r} is not a string"
            problem = _not_json(item)
            if problem:
                return problem
        return None
    return f"a {type(value).__name__} ({value!r:.60}) is not JSON; pass lists, dicts, strings, numbers, booleans"


def function_code(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], packages: Sequence[str]
) -> ShippedCode:
    """The files that run ``fn(*args, **kwargs)`` in every worker."""
    source = function_source(fn)
    call_args, call_kwargs = arguments_json(args, kwargs)
    call = {
        "module": FUNCTION_MODULE,
        "function": fn.__name__,
        "args": call_args,
        "kwargs": call_kwargs,
        "packages": list(packages),
    }
    files = {f"{FUNCTION_MODULE}.py": source, CALL_FILE: json.dumps(call, indent=1), RUNNER_FILE: RUNNER}
    return ShippedCode(files=files, binary={}, entry=RUNNER_FILE)


def script_code(path: str | os.PathLike[str], entry: str | None = None) -> ShippedCode:
    """A script, or a directory's files (``entry`` the script to run, relative to it), skipping
    caches and ``.git``. Files that are not UTF-8 text travel as binaryData."""
    root = Path(path)
    if root.is_file():
        found = [(root.name, root)]
        entry = entry or root.name
    elif root.is_dir():
        found = []
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_NAMES)
            for filename in sorted(names):
                if filename.endswith((".pyc", ".pyo")):
                    continue
                file = Path(directory, filename)
                found.append((file.relative_to(root).as_posix(), file))
        entry = entry or "train.py"
    else:
        raise CodeRefused(f"{root} is neither a file nor a directory")
    files: dict[str, str] = {}
    binary: dict[str, bytes] = {}
    total = 0
    for relative, file in found:
        data = file.read_bytes()
        total += len(data)
        if total > CONFIG_MAP_LIMIT:  # stop reading early: it cannot fit anyway
            raise too_large(f"{root} holds more than", CONFIG_MAP_LIMIT)
        try:
            files[relative] = data.decode()
        except UnicodeDecodeError:
            binary[relative] = data
    if entry not in files:
        raise CodeRefused(f"the entry script {entry!r} is not among the text files shipped from {root}")
    return ShippedCode(files=files, binary=binary, entry=entry)


def too_large(what: str, size: int) -> CodeRefused:
    return CodeRefused(
        f"{what} {size} bytes; a ConfigMap holds at most {CONFIG_MAP_LIMIT} bytes (1 MiB, the whole object):"
        " ship less (a package in the image, data in a volume)"
    )


def _key(relative: str) -> str:
    """A ConfigMap key for a relative path (keys are [-._a-zA-Z0-9]+; the volume's items map them back)."""
    return re.sub(r"[^-._a-zA-Z0-9]", "_", relative.replace("/", "--"))


def code_config_map_name(job_name: str) -> str:
    return f"{job_name}-code"


def code_config_map(job_name: str, namespace: str, code: ShippedCode) -> dict[str, Any]:
    """The ConfigMap of ``code`` (owner set once the job exists); CodeRefused past 1 MiB."""
    config_map: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": code_config_map_name(job_name),
            "namespace": namespace,
            "labels": {naming.JOB_NAME_LABEL: job_name},
            "annotations": {CODE_DIGEST_ANNOTATION: code.digest},
        },
        "data": {_key(path): text for path, text in code.files.items()},
    }
    if code.binary:
        config_map["binaryData"] = {_key(path): base64.b64encode(data).decode() for path, data in code.binary.items()}
    size = len(json.dumps(config_map, separators=(",", ":")).encode())
    if size > CONFIG_MAP_LIMIT:
        raise too_large("the code's ConfigMap is", size)
    return config_map


def code_volume(job_name: str, code: ShippedCode) -> dict[str, Any]:
    """The volume of the ConfigMap; items map keys back to paths when a path is not its key."""
    volume: dict[str, Any] = {"name": CODE_VOLUME, "configMap": {"name": code_config_map_name(job_name)}}
    paths = sorted({*code.files, *code.binary})
    if any(_key(path) != path for path in paths):
        volume["configMap"]["items"] = [{"key": _key(path), "path": path} for path in paths]
    return volume


def job_name_for(base: str) -> str:
    """A fresh job name from a function's or script's name: lowercase DNS label, a random suffix."""
    stem = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-") or "job"
    stem = stem[: api.MAX_JOB_NAME_LENGTH - 6].rstrip("-") or "job"
    return f"{stem}-{secrets.token_hex(3)[:5]}"


def workers_range(workers: int | tuple[int, int]) -> dict[str, int]:
    if isinstance(workers, tuple):
        low, high = workers
        return {"min": low, "max": high, "desired": high}
    return {"min": workers, "max": workers, "desired": workers}


def code_job(
    name: str,
    namespace: str,
    code: ShippedCode,
    *,
    workers: int | tuple[int, int] = 1,
    gpus: int = 0,
    image: str = DEFAULT_IMAGE,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu: str | None = None,
    memory: str | None = None,
    labels: Mapping[str, str] | None = None,
    image_pull_policy: str | None = None,
) -> dict[str, Any]:
    """The TrainingJob that runs ``code`` under torchrun in every worker."""
    container: dict[str, Any] = {
        "name": "trainer",
        "image": image,
        "command": ["torchrun"],
        "args": [f"$({CODE_DIR_ENV})/{code.entry}", *args],
        "env": [{"name": CODE_DIR_ENV, "value": CODE_MOUNT_PATH}]
        + [{"name": key, "value": str(value)} for key, value in (env or {}).items()],
        "volumeMounts": [{"name": CODE_VOLUME, "mountPath": CODE_MOUNT_PATH, "readOnly": True}],
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    requests = {key: value for key, value in (("cpu", cpu), ("memory", memory)) if value}
    if requests:
        container["resources"] = {"requests": requests}
    spec: dict[str, Any] = {
        "workers": workers_range(workers),
        "template": {"spec": {"containers": [container], "volumes": [code_volume(name, code)]}},
    }
    if gpus:
        spec["gpus"] = {"count": gpus}
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels or {}),
            "annotations": {CODE_DIGEST_ANNOTATION: code.digest},
        },
        "spec": spec,
    }
