"""Render deploy/ with `kubectl kustomize` and walk what comes out.

Variants: the two overlays as shipped, and the base with each component that no overlay
enables (hpa, mtls, external-redis), so that every file under deploy/ renders in some test.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("overlays/gpu", "overlays/cpu-dev")
# name -> components added to the base (rendered through a temporary kustomization)
COMPOSED = {
    "base+hpa+monitoring": ("hpa", "monitoring"),
    "base+mtls": ("mtls",),
    "base+external-redis": ("external-redis",),
}
VARIANTS = (*OVERLAYS, *COMPOSED)
CRD_KINDS = {"ScaledObject", "PodMonitor", "ServiceMonitor", "PrometheusRule"}


def require_kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        reason = "kubectl is not installed: deploy/ manifests were not rendered or checked"
        warnings.warn(reason, stacklevel=2)  # shown in the summary, -q or not
        pytest.skip(reason)
    return kubectl


@functools.cache
def _render_cached(variant: str) -> str:
    kubectl = require_kubectl()
    if variant in COMPOSED:
        with tempfile.TemporaryDirectory() as tmp:
            rel = os.path.relpath(DEPLOY, tmp)
            lines = [
                "apiVersion: kustomize.config.k8s.io/v1beta1",
                "kind: Kustomization",
                "resources:",
                f"  - {rel}/base",
                "components:",
                *(f"  - {rel}/components/{c}" for c in COMPOSED[variant]),
            ]
            (Path(tmp) / "kustomization.yaml").write_text("\n".join(lines) + "\n")
            return _kustomize(kubectl, tmp)
    return _kustomize(kubectl, str(DEPLOY / variant))


def _kustomize(kubectl: str, path: str) -> str:
    result = subprocess.run(
        [kubectl, "kustomize", path], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return result.stdout


def render(variant: str) -> list[dict]:
    """The resources of one variant (fresh copies: tests may not share mutations)."""
    return [d for d in yaml.safe_load_all(_render_cached(variant)) if d]


def pod_specs(resources: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, pod spec) of every Deployment and StatefulSet."""
    for r in resources:
        if r["kind"] in ("Deployment", "StatefulSet"):
            yield r, r["spec"]["template"]["spec"]


def containers(resources: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, container) of every container, init containers included."""
    for r, spec in pod_specs(resources):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield r, c


def component(r: dict) -> str:
    return r["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
