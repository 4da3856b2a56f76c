"""The CustomResourceDefinitions the cluster tiers install: phalanx's own and the coscheduling
PodGroup from the scheduler-plugins module download (the one its binaries are built from). A
cluster has one gang scheduler as a rule, so the tiers run with that one only: tests of Volcano
install the stand-in for its PodGroup (Volcano's module is not served by the Go module proxy here;
the stand-in follows its published CRD) and remove it again (``tests/integration/conftest.py``
``volcano_api``)."""

from __future__ import annotations

from pathlib import Path

from phalanx.api import crd
from tests.cluster import binaries

ROOT = Path(__file__).resolve().parents[2]
VOLCANO_STAND_IN = ROOT / "tests" / "fixtures" / "crds" / "podgroups.scheduling.volcano.sh.yaml"


def coscheduling_crd() -> Path:
    return binaries.module_source("scheduler-plugins") / "manifests" / "coscheduling" / "crd.yaml"


def cluster_crds() -> list[Path]:
    """What the operator's tiers install: TrainingJob and one gang scheduler's PodGroup API."""
    return [ROOT / "crds" / crd.CRD_FILE, coscheduling_crd()]
