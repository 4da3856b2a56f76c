"""The trainer image's Transformers are the versions the progress callback's unit tests ran."""

from __future__ import annotations

import re

from tests.cluster.node import images
from tests.cluster.node.host import REPO_ROOT


def test_the_dockerfile_default_is_the_frameworks_extras_pins() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    default = re.search(r'^ARG TRANSFORMERS_REQUIREMENTS="([^"]*)"$', dockerfile, re.MULTILINE)
    assert default is not None, "the trainer stage names its Transformers requirements in an ARG"
    assert default.group(1).split() == images.transformers_requirements()
    assert [pin.split("==")[0] for pin in images.transformers_requirements()] == ["transformers", "accelerate"]
    torch_step = dockerfile.index('pip install --no-cache-dir "torch==')
    assert torch_step < dockerfile.index("pip install --no-cache-dir ${TRANSFORMERS_REQUIREMENTS}")
