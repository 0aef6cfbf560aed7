"""deploy/ renders, and what it renders is valid: core kinds against Kubernetes' own OpenAPI
schemas (kubernetes-validate, strict: unknown fields are errors), KEDA and prometheus-operator
kinds against the CRD schemas kept in deploy/schemas/, and every service's argv against the
service's real argument parser (only flags that exist)."""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.manifests import CRD_KINDS, DEPLOY, VARIANTS, containers, render

# The oldest Kubernetes we claim (grpc probes, NetworkPolicy endPort, autoscaling/v2 are GA
# there), and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
SCHEMAS = {
    "PodMonitor": "podmonitor-monitoring-v1.json",
    "ServiceMonitor": "servicemonitor-monitoring-v1.json",
    "PrometheusRule": "prometheusrule-monitoring-v1.json",
    "ScaledObject": "scaledobject-keda-v1alpha1.json",
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_renders(variant):
    kinds = {r["kind"] for r in render(variant)}
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= kinds


def _unique(resources_by_variant):
    seen: dict[str, tuple[str, dict]] = {}
    for variant in VARIANTS:
        for r in render(variant):
            seen.setdefault(json.dumps(r, sort_keys=True), (variant, r))
    return seen.values()


def test_core_kinds_are_valid_kubernetes_strict():
    checked = 0
    for variant, r in _unique(None):
        if r["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(r, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                pytest.fail(
                    f"{variant}: {r['kind']}/{r['metadata']['name']} at {path}: {e.message}"
                )
        checked += 1
    assert checked >= 25


@pytest.mark.parametrize("kind", sorted(CRD_KINDS))
def test_custom_resources_match_their_crd_schema(kind):
    schema = json.loads((DEPLOY / "schemas" / SCHEMAS[kind]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    found = [(v, r) for v, r in _unique(None) if r["kind"] == kind]
    assert found, f"no {kind} is rendered by any variant"
    for variant, r in found:
        errors = sorted(validator.iter_errors(r), key=lambda e: list(e.path))
        assert not errors, f"{variant}: {kind}/{r['metadata']['name']}: " + "; ".join(
            f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors
        )


def test_crd_schemas_reject_what_the_api_server_would():
    """The schemas are strict (a typo is an error) and keep the CRDs' enums and patterns."""
    validator = jsonschema.Draft202012Validator(
        json.loads((DEPLOY / "schemas" / SCHEMAS["PrometheusRule"]).read_text())
    )
    good = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "x"},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": "5m"}]}]},
    }
    assert not list(validator.iter_errors(good))
    typo = json.loads(json.dumps(good))
    typo["spec"]["groups"][0]["rules"][0]["annotation"] = {}
    bad_for = json.loads(json.dumps(good))
    bad_for["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    for doc in (typo, bad_for):
        assert list(validator.iter_errors(doc))
    keda = jsonschema.Draft202012Validator(
        json.loads((DEPLOY / "schemas" / SCHEMAS["ScaledObject"]).read_text())
    )
    so = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "d"}, "triggers": [{"type": "cpu", "metadata": {}}]},
    }
    assert not list(keda.iter_errors(so))
    so["spec"]["triggers"][0]["metricType"] = "Average"
    assert list(keda.iter_errors(so))


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of args, with env values standing in."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), f"$({m.group(1)})"), arg)


def _argv(resources: list[dict], c: dict) -> list[str]:
    env = {"POD_NAME": "pod-0", "POD_NAMESPACE": "tandem", "POD_IP": "10.0.0.1"}
    for ref in c.get("envFrom", []):
        name = ref["configMapRef"]["name"]
        cm = next(
            r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name
        )
        env.update(cm["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
    return [_expand(a, env) for a in c.get("args", [])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_args_parse_with_the_services_own_parsers(variant):
    """Every flag in the manifests exists, with a value of the right type."""
    from decode_svc.server import build_parser as decode_parser
    from gateway.__main__ import parse_args as gateway_parse_args
    from prefill_svc.server import build_parser as prefill_parser

    parsers = {"decode": decode_parser, "prefill": prefill_parser}

    resources = render(variant)
    roles = set()
    for _, c in containers(resources):
        argv = _argv(resources, c)
        if not argv or argv[0] not in ("gateway", "prefill", "decode"):
            continue
        role, rest = argv[0], argv[1:]
        assert not [a for a in argv if "$(" in a], f"unexpanded variable in {argv}"
        try:
            if role == "gateway":
                args = gateway_parse_args(rest)
                assert args.host == "0.0.0.0" and args.metrics_host == "0.0.0.0"
            else:
                args = parsers[role]().parse_args(rest)
                assert args.advertise_address and not args.advertise_address.startswith("0.")
                assert args.metrics_port is not None and args.metrics_host == "0.0.0.0"
        except SystemExit:
            pytest.fail(f"{variant}: tandem {role} rejects its manifest's args: {argv}")
        roles.add(role)
    assert roles == {"gateway", "prefill", "decode"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscalers_target_rendered_pools(variant):
    """Each ScaledObject / HPA scales a Deployment of this render, one autoscaler per pool, and
    KEDA's admission rule holds: `fallback` only when every trigger is AverageValue."""
    resources = render(variant)
    deployments = {r["metadata"]["name"] for r in resources if r["kind"] == "Deployment"}
    targets = []
    for r in resources:
        if r["kind"] not in ("ScaledObject", "HorizontalPodAutoscaler"):
            continue
        ref = r["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        targets.append(ref["name"])
        if r["kind"] == "ScaledObject" and "fallback" in r["spec"]:
            types = {t.get("metricType", "AverageValue") for t in r["spec"]["triggers"]}
            assert types == {"AverageValue"}, r["metadata"]["name"]
    assert len(targets) == len(set(targets))
    assert set(targets) <= {"tandem-prefill", "tandem-decode", "tandem-gateway"}
