"""Policy over everything deploy/ renders: the rules of docs/security.md ("What an operator must
isolate") and docs/operations.md, checked on the manifests rather than trusted."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.manifests import DEPLOY, VARIANTS, component, containers, pod_specs, render

POOLS = ("gateway", "prefill", "decode")
# Credentials inside a URL (scheme://user:password@host), a Redis password line, a PEM key,
# or something shaped like an API key / token.
_SECRET_VALUE = re.compile(
    r"://[^/\s:@]*:[^/\s@]+@|requirepass\s+(?!<)\S|-----BEGIN [A-Z ]*PRIVATE KEY"
    r"|\bsk-[A-Za-z0-9]{16,}|\b[0-9a-f]{32,}\b"
)
_SECRET_ENV = re.compile(r"TOKEN|PASSWORD|SECRET|API_KEYS|REDIS_URL|TLS_(CERT|KEY|CA)")


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


@pytest.fixture(scope="module", params=VARIANTS)
def resources(request):
    return render(request.param)


def test_no_insecure_internal_anywhere(resources):
    assert not [s for s in _strings(resources) if "insecure-internal" in s]


def test_no_secret_values_in_manifests(resources):
    """Secrets are created by the operator: no Secret object, and no string anywhere (config
    files, scripts and the dashboard included) that looks like a credential."""
    assert not [r for r in resources if r["kind"] == "Secret"]
    leaks = [s[:60] for s in _strings(resources) if _SECRET_VALUE.search(s)]
    assert not leaks, f"secret-looking literals: {leaks}"


def test_secrets_only_as_mounted_files(resources):
    for r, c in containers(resources):
        where = f"{r['metadata']['name']}/{c['name']}"
        assert not [e for e in c.get("envFrom", []) if "secretRef" in e], where
        for e in c.get("env", []):
            assert "secretKeyRef" not in e.get("valueFrom", {}), f"{where}: {e['name']}"
            if _SECRET_ENV.search(e["name"]):
                # Only *_FILE / TLS path variables, pointing into a mounted secret volume.
                assert e["name"].endswith("_FILE") or "TLS_" in e["name"], f"{where}: {e['name']}"
                assert _is_in_secret_mount(r, c, e["value"]), f"{where}: {e['name']}"
        argv = " ".join(c.get("args", []) + c.get("command", []))
        assert "--api-keys " not in argv and not re.search(r"--redis-url\s+\S*@", argv), where
    for _, spec in pod_specs(resources):
        assert spec.get("automountServiceAccountToken") is False


def _is_in_secret_mount(workload: dict, container: dict, path: str) -> bool:
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/") and "secret" in volumes[m["name"]]:
            return m.get("readOnly") is True
    return False


def test_images_are_pinned(resources):
    for r, c in containers(resources):
        image = c["image"]
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{r['metadata']['name']}: untagged image {image}"
        assert tag != "latest" and not tag.startswith("latest"), f"{image}"


def test_every_container_has_probes_and_resources(resources):
    for r, c in containers(resources):
        where = f"{r['metadata']['name']}/{c['name']}"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert probe in c, f"{where} has no {probe}"
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"].get(kind, {})), f"{where}: {kind}"


def test_pool_probes_mean_different_things(resources):
    """Readiness asks for the service's own name (engine serving), liveness for the overall
    health (process answers); the gateway's liveness does not depend on the decodes."""
    for r, c in containers(resources):
        role = component(r)
        if role in ("prefill", "decode"):
            ready, live = c["readinessProbe"], c["livenessProbe"]
            service = f"tandem.v1.{role.capitalize()}"
            if "grpc" in ready:
                assert ready["grpc"].get("service") == service
                assert not live["grpc"].get("service")
            else:  # mtls: exec probes carry the same meaning
                assert ready["exec"]["command"][-1] == service
                assert live["exec"]["command"][-1].endswith("health_probe.py")
            start = c["startupProbe"]
            budget_s = start["periodSeconds"] * start["failureThreshold"]
            assert budget_s >= 300, f"{role}: start-up budget {budget_s} s"
        elif role == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["livenessProbe"]["httpGet"]["path"] != "/health"


def test_pods_are_hardened(resources):
    for r, spec in pod_specs(resources):
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, r["metadata"]["name"]
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault"
        for c in spec["containers"]:
            sc = c.get("securityContext", {})
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]


def test_drain_fits_in_the_grace_period(resources):
    """Gateways: a preStop delay, then uvicorn's own drain. Prefill and decode drain themselves
    on SIGTERM for --drain-timeout-s, which must end before the kubelet's SIGKILL."""
    for r, spec in pod_specs(resources):
        role = component(r)
        if role not in POOLS:
            continue
        c = spec["containers"][0]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]]
        grace = spec["terminationGracePeriodSeconds"]
        if role == "gateway":
            pre_stop_s = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            assert grace >= pre_stop_s + 60, f"gateway: grace {grace} s"
            continue
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        args = c["args"]
        last = max(i for i, a in enumerate(args) if a == "--drain-timeout-s")  # the one that counts
        drain_s = float(args[last + 1])
        assert grace >= drain_s + 10, f"{role}: grace {grace} s < drain {drain_s} s + 10"


def test_one_pdb_per_pool(resources):
    pdbs = [r for r in resources if r["kind"] == "PodDisruptionBudget"]
    for r in resources:
        if r["kind"] == "Deployment":
            labels = r["spec"]["template"]["metadata"]["labels"]
            matching = [
                p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
            ]
            assert len(matching) == 1, r["metadata"]["name"]
            assert r["spec"].get("replicas", 1) >= (2 if component(r) == "gateway" else 1)


def test_network_policies_isolate_the_planes(resources):
    policies = {r["metadata"]["name"]: r for r in resources if r["kind"] == "NetworkPolicy"}
    deny = policies["tandem-default-deny"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny
    ingress_ports: dict[int, set[str]] = {}
    for p in policies.values():
        for rule in p["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                sources = {
                    json.dumps(f, sort_keys=True) for f in rule.get("from", [{"anywhere": 1}])
                }
                ingress_ports.setdefault(port["port"], set()).update(sources)
    # Only the gateway's HTTP port is open to anyone.
    open_ports = [port for port, srcs in ingress_ports.items() if '{"anywhere": 1}' in srcs]
    assert open_ports == [8000]
    assert all("monitoring" in s for s in ingress_ports[9400])
    assert all("gateway" in s or "decode" in s for s in ingress_ports[50051])
    assert all("prefill" in s or "decode" in s for s in ingress_ports[21000])


def test_gpu_overlay_requests_gpus():
    for r, c in containers(render("overlays/gpu")):
        if component(r) in ("prefill", "decode"):
            for kind in ("requests", "limits"):
                assert c["resources"][kind]["nvidia.com/gpu"] == 1
    for _, c in containers(render("overlays/cpu-dev")):
        assert "nvidia.com/gpu" not in json.dumps(c["resources"])


def test_dockerfiles_are_pinned_nonroot_and_use_setup_sh():
    for path in sorted((DEPLOY / "docker").glob("Dockerfile.*")):
        if path.suffix == ".dockerignore":
            continue
        text = path.read_text()
        bases = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
        assert bases, path.name
        for base in bases:
            tag = base.rpartition(":")[2]
            assert "@sha256:" in base or re.fullmatch(r"[\w.-]*\d[\w.-]*", tag), base
            assert "latest" not in base, base
        assert "bash scripts/setup.sh" in text, path.name
        users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("root", "0"), path.name
        # No credentials baked in: no ENV/ARG named like one.
        assert not re.search(r"^(ENV|ARG)\s+\S*(TOKEN|PASSWORD|SECRET|API_KEY)", text, re.M)
        assert (path.parent / f"{path.name}.dockerignore").is_file(), path.name
