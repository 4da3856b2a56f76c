"""The argocd-cm patch users install carries exactly the scripts Argo CD's layout holds (which the
integration tier runs in gopher-lua against captured TrainingJobs)."""

from __future__ import annotations

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARGOCD = ROOT / "deploy" / "argocd"
SCRIPTS = ARGOCD / "resource_customizations" / "phalanx.dev" / "TrainingJob"


def test_the_argocd_cm_patch_inlines_the_scripts_unchanged() -> None:
    data = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())["data"]
    assert data["resource.customizations.health.phalanx.dev_TrainingJob"] == (SCRIPTS / "health.lua").read_text()
    actions = yaml.safe_load(data["resource.customizations.actions.phalanx.dev_TrainingJob"])
    assert actions["discovery.lua"] == (SCRIPTS / "actions" / "discovery.lua").read_text()
    definitions = {d["name"]: d["action.lua"] for d in actions["definitions"]}
    assert definitions == {
        name: (SCRIPTS / "actions" / name / "action.lua").read_text() for name in ("suspend", "resume")
    }


def test_every_argocd_test_case_names_a_file_that_exists() -> None:
    health = yaml.safe_load((SCRIPTS / "health_test.yaml").read_text())["tests"]
    actions = yaml.safe_load((SCRIPTS / "actions" / "action_test.yaml").read_text())
    paths = [SCRIPTS / case["inputPath"] for case in health]
    paths += [SCRIPTS / "actions" / case["inputPath"] for case in actions["discoveryTests"]]
    for case in actions["actionTests"]:
        paths += [SCRIPTS / "actions" / case["inputPath"], SCRIPTS / "actions" / case["expectedOutputPath"]]
    assert [path for path in paths if not path.is_file()] == []
