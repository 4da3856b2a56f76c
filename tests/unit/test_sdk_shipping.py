"""The SDK's code shipping: a function's source (from a file, or a notebook cell that IPython keeps
in linecache), its arguments as JSON, a directory within the ConfigMap limit, the job that runs
it (accepted by offline admission), and the runner script, run here as a worker would run it."""

from __future__ import annotations

import json
import linecache
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from phalanx.sdk import CodeRefused, shipping, specs


def uses_a_module(path: str) -> None:
    os.makedirs(path, exist_ok=True)


def recursive(n: int) -> int:
    return 1 if n <= 1 else n * recursive(n - 1)


THRESHOLD = 3


def uses_a_constant() -> int:
    return THRESHOLD


def from_cell(source: str, filename: str = "<ipython-input-7-0123456789ab>") -> Callable[..., Any]:
    """Define a function as IPython runs a notebook cell: compiled under a made-up file name whose
    lines it puts in linecache."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    function: Callable[..., Any] = namespace["train"]
    return function


def test_a_module_function_ships_with_the_imports_of_the_modules_it_uses() -> None:
    source = shipping.function_source(uses_a_module)
    assert source.startswith("import os\n")
    assert "def uses_a_module(path: str) -> None:\n    os.makedirs(path, exist_ok=True)" in source


def test_a_recursive_function_needs_nothing_but_itself() -> None:
    assert shipping.function_source(recursive).startswith("def recursive(")


def test_a_function_from_a_notebook_cell_ships_its_source() -> None:
    cell = "import math\n\ndef train(steps, lr=0.1):\n    return math.sqrt(steps) * lr\n"
    source = shipping.function_source(from_cell(cell))
    assert source == "import math\n\n\ndef train(steps, lr=0.1):\n    return math.sqrt(steps) * lr\n"


def test_an_indented_definition_is_dedented() -> None:
    cell = "if True:\n    def train():\n        return 1\n"
    assert shipping.function_source(from_cell(cell, "<cell-indented>")) == "def train():\n    return 1\n"


@pytest.mark.parametrize(
    ("function", "words"),
    [
        (lambda: 1, "a lambda cannot be shipped"),
        (print, "is not a Python function"),
        (uses_a_constant, "uses global names that are not modules: THRESHOLD"),
    ],
)
def test_what_cannot_run_from_its_source_alone_is_refused(function: Callable[..., Any], words: str) -> None:
    with pytest.raises(CodeRefused, match=words):
        shipping.function_source(function)


def test_a_closure_is_refused() -> None:
    factor = 3

    def scaled(x: int) -> int:
        return x * factor

    with pytest.raises(CodeRefused, match="defined inside another function"):
        shipping.function_source(scaled)


def test_a_function_without_source_is_refused() -> None:
    namespace: dict[str, Any] = {}
    exec(compile("def train():\n    return 1\n", "<stdin>", "exec"), namespace)
    with pytest.raises(CodeRefused, match="the source of train cannot be found"):
        shipping.function_source(namespace["train"])


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        ((float("nan"),), {}, "argument 1 cannot be shipped as JSON: nan is not a finite number"),
        ((), {"shape": (2, 3)}, r"shape cannot be shipped as JSON: a tuple \(\(2, 3\)\) is not JSON"),
        ((), {"table": {1: "a"}}, "a dict key 1 is not a string"),
        (({"nested": [object()]},), {}, "a object"),
    ],
)
def test_arguments_that_json_cannot_carry_are_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(CodeRefused, match=words):
        shipping.arguments_json(args, kwargs)


def test_json_arguments_travel_as_given() -> None:
    args, kwargs = shipping.arguments_json([1, "a", [2.5, None]], {"config": {"lr": 0.1, "ok": True}})
    assert (args, kwargs) == ([1, "a", [2.5, None]], {"config": {"lr": 0.1, "ok": True}})


def test_a_directory_ships_its_files_but_caches_and_git(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "model.py").write_text("X = 1\n")
    (tmp_path / "lib" / "weights.bin").write_bytes(b"\xff\x00\xfe")
    for skipped in ("__pycache__", ".git"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "junk.py").write_text("junk\n")
    code = shipping.script_code(tmp_path)
    assert code.entry == "train.py"
    assert sorted(code.files) == ["lib/model.py", "train.py"]
    assert code.binary == {"lib/weights.bin": b"\xff\x00\xfe"}
    config_map = shipping.code_config_map("demo", "ml", code)
    assert config_map["metadata"]["name"] == "demo-code"
    assert config_map["metadata"]["labels"] == {"phalanx.dev/job-name": "demo"}
    assert config_map["data"] == {"lib--model.py": "X = 1\n", "train.py": "print('hi')\n"}
    assert config_map["binaryData"] == {"lib--weights.bin": "/wD+"}
    volume = shipping.code_volume("demo", code)
    assert volume["configMap"]["items"] == [
        {"key": "lib--model.py", "path": "lib/model.py"},
        {"key": "lib--weights.bin", "path": "lib/weights.bin"},
        {"key": "train.py", "path": "train.py"},
    ]


def test_code_past_the_config_map_limit_is_refused_naming_size_and_limit(tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "data.txt").write_text("x" * (shipping.CONFIG_MAP_LIMIT - 100))
    with pytest.raises(CodeRefused, match=r"the code's ConfigMap is 10\d{5} bytes; a ConfigMap holds at most 1048576"):
        shipping.code_config_map("demo", "ml", shipping.script_code(tmp_path))
    (tmp_path / "more.txt").write_text("y" * 200)
    with pytest.raises(CodeRefused, match=r"holds more than 1048\d{3} bytes; a ConfigMap holds at most 1048576"):
        shipping.script_code(tmp_path)


def test_a_missing_entry_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "main.py").write_text("pass\n")
    with pytest.raises(CodeRefused, match=r"the entry script 'train\.py' is not among"):
        shipping.script_code(tmp_path)


def test_the_function_job_is_accepted_offline_and_follows_the_shipping_contract() -> None:
    code = shipping.function_code(uses_a_module, ["/tmp/x"], {}, ["tqdm==4.67.1"])
    body = shipping.code_job(
        "fn-abcde", "ml", code, workers=(1, 3), image="phalanx.local/trainer:dev", env={"SEED": "1"}, cpu="500m"
    )
    verdict = specs.plan(body, "ml")
    assert verdict.accepted, verdict.message
    container = body["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    assert container["args"] == ["$(PHALANX_CODE_DIR)/phalanx_run.py"]
    assert {"name": "PHALANX_CODE_DIR", "value": "/etc/phalanx/code"} in container["env"]
    assert container["volumeMounts"] == [{"name": "phalanx-code", "mountPath": "/etc/phalanx/code", "readOnly": True}]
    volumes = body["spec"]["template"]["spec"]["volumes"]
    assert volumes == [{"name": "phalanx-code", "configMap": {"name": "fn-abcde-code"}}]
    assert body["spec"]["workers"] == {"min": 1, "max": 3, "desired": 3}
    assert body["metadata"]["annotations"][shipping.CODE_DIGEST_ANNOTATION] == code.digest
    call = json.loads(code.files[shipping.CALL_FILE])
    assert call == {
        "module": "phalanx_function",
        "function": "uses_a_module",
        "args": ["/tmp/x"],
        "kwargs": {},
        "packages": ["tqdm==4.67.1"],
    }


def test_job_names_are_dns_labels_with_a_fresh_suffix() -> None:
    first, second = shipping.job_name_for("Train_Model!"), shipping.job_name_for("Train_Model!")
    assert first.startswith("train-model-") and len(first) == len("train-model-") + 5 and first != second
    assert len(shipping.job_name_for("x" * 100)) <= 50


def test_the_runner_calls_the_function_with_its_arguments(tmp_path: pathlib.Path) -> None:
    cell = textwrap.dedent(
        """\
        import json, os

        def train(path, steps, scale=1.0):
            with open(path, "w") as out:
                json.dump({"steps": steps, "scale": scale, "rank": os.environ.get("LOCAL_RANK")}, out)
        """
    )
    code = shipping.function_code(from_cell(cell, "<cell-runner>"), [str(tmp_path / "out.json"), 5], {"scale": 2.5}, [])
    for path, text in shipping.code_config_map("t", "ml", code)["data"].items():
        (tmp_path / path).write_text(text)
    environment = {**os.environ, "LOCAL_RANK": "0"}
    subprocess.run([sys.executable, str(tmp_path / code.entry)], check=True, env=environment, timeout=60)
    assert json.loads((tmp_path / "out.json").read_text()) == {"steps": 5, "scale": 2.5, "rank": "0"}


def test_the_docs_notebook_function_trains_under_torchrun(tmp_path: pathlib.Path) -> None:
    """docs/sdk.md's training function, shipped as a notebook cell would be, runs through the
    runner in two torchrun workers over gloo (a shorter run than the doc's)."""
    pytest.importorskip("torch")
    text = (pathlib.Path(__file__).parents[2] / "docs" / "sdk.md").read_text()
    cells = re.findall(r"<!-- notebook cell -->\n```python\n(.*?)```", text, re.DOTALL)
    assert len(cells) >= 3 and "submit_function(" in cells[1] and "client.wait(" in cells[2]
    code = shipping.function_code(from_cell(cells[0], "<ipython-input-1-docs>"), [40], {"lr": 0.05}, [])
    for path, source in shipping.code_config_map("docs", "ml", code)["data"].items():
        (tmp_path / path).write_text(source)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / code.entry)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 40/40 loss" in done.stdout
