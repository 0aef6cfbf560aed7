"""Every metric that deploy/ names (alerts, dashboard, KEDA and prometheus-adapter queries)
is exported by a live service of the pool it is selected from: a real prefill, decode and
gateway on a tiny model with Redis, scraped after real requests. Also runs the mtls
component's exec health probe against the live services (under mTLS) with the gRPC service
names the manifests' probes use."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tandem.launcher import Cluster
from tests.deploy.manifests import DEPLOY, component, containers, render
from tests.deploy.promql import exported_names, selectors
from tests.fixtures.pki import make_pki, tls_env
from tests.redis_server import RedisServer

FLAGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "64", "--heartbeat-s", "0.2"]
SCRIPTS = DEPLOY / "base" / "files"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _named_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every query deploy/ ships."""
    out = []
    monitoring = DEPLOY / "components" / "monitoring"
    rule = yaml.safe_load((monitoring / "prometheusrule.yaml").read_text())
    for g in rule["spec"]["groups"]:
        out += [(f"alert {r['alert']}", r["expr"]) for r in g["rules"]]
    dashboard = json.loads((monitoring / "tandem-dashboard.json").read_text())
    for p in dashboard["panels"]:
        out += [(f"panel {p['title']!r}", t["expr"]) for t in p["targets"]]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":  # label_values(METRIC, LABEL): the metric is the first argument
            metric = v["query"]["query"].split("(", 1)[1].split(",", 1)[0]
            out.append((f"variable {v['name']}", metric))
    for so in yaml.safe_load_all(
        (DEPLOY / "components" / "keda" / "scaledobjects.yaml").read_text()
    ):
        triggers = [t for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
        out += [(f"keda {t['name']}", t["metadata"]["query"]) for t in triggers]
    adapter = yaml.safe_load(
        (DEPLOY / "components" / "hpa" / "prometheus-adapter.yaml").read_text()
    )
    for r in adapter["rules"] + adapter["externalRules"]:
        out += [(f"adapter {r['name']['as']}", r["seriesQuery"])]
    return out


def test_the_extractor_finds_names_and_pools():
    expr = (
        'histogram_quantile(0.99, sum by (namespace, le) (rate(vllm:a_bucket{pool="gateway",'
        'le="+Inf"}[5m]))) > 2 and on (x) changes(process_start_time_seconds[30m]) or '
        'sum(rate(tandem:b_total{namespace="$namespace",pool=~"prefill|decode"}[$__rate_interval]))'
    )
    assert selectors(expr) == {
        ("vllm:a_bucket", ("gateway",)),
        ("process_start_time_seconds", None),
        ("tandem:b_total", ("prefill", "decode")),
    }


@pytest.fixture(scope="module")
def live(tiny_qwen3_path, tmp_path_factory):
    """Scrapes of a live prefill, decode and gateway after work, plus their addresses. They run
    as the mtls component configures them (token and mTLS), so the exec probe is tested too."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs it)")
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    cluster = Cluster(log_prefix=False)
    model = str(tiny_qwen3_path)
    ports = {role: _free_port() for role in ("prefill", "decode", "gateway")}
    redis_flags = ["--redis-url", redis.url]
    try:
        with pytest.MonkeyPatch.context() as mp:  # inherited by the children only
            for name, value in tls_env(pki).items():
                mp.setenv(name, value)
            started = {
                role: cluster.spawn(
                    role, [model, *FLAGS, *redis_flags, "--metrics-port", str(ports[role])]
                )
                for role in ("prefill", "decode")
            }
            gateway_argv = ["--model", model, "--port", "0", *redis_flags]
            started["gateway"] = cluster.spawn(
                "gateway", [*gateway_argv, "--metrics-port", str(ports["gateway"])]
            )
        for role, child in started.items():
            assert child.ready.wait(180) and child.address, f"{role} did not start"
        _work(f"http://{started['gateway'].address}", model)
        scrapes = {
            role: httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            for role, port in ports.items()
        }
        yield {
            "scrapes": scrapes,
            "metrics_ports": ports,
            "grpc": {role: started[role].address for role in ("prefill", "decode")},
            "pki": pki,
        }
    finally:
        cluster.stop()
        redis.kill()


def _work(url: str, model: str) -> None:
    """Streamed and unstreamed requests once the gateway sees a decode."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(300):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        body = {"model": model, "prompt": "hello world " * 20, "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        messages = [{"role": "user", "content": "hi " * 30}]
        chat = {"model": model, "messages": messages, "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200
            assert "[DONE]" in "".join(r.iter_text())


def test_every_named_metric_is_exported_by_its_pool(live):
    exported = {role: exported_names(text) for role, text in live["scrapes"].items()}
    missing, checked = [], 0
    for where, expr in _named_expressions():
        for name, pools in selectors(expr):
            checked += 1
            if pools:  # selected with pool="..." or pool=~"a|b": each of them must export it
                missing += [f"{where}: {name} ({p})" for p in pools if name not in exported[p]]
            elif not any(name in names for names in exported.values()):
                missing.append(f"{where}: {name}")
    assert checked >= 40, checked
    assert not missing, "not exported by a live service:\n" + "\n".join(sorted(set(missing)))


def test_the_work_was_measured(live):
    """The scrapes are not empty shells: the requests went through P/D and were counted."""
    gateway, decode = live["scrapes"]["gateway"], live["scrapes"]["decode"]
    assert "vllm:time_to_first_token_seconds_count{model_name=" in gateway
    assert "tandem:num_remote_prefills_total" in decode
    assert "tandem:kv_transfer_bytes_total" in live["scrapes"]["prefill"]


def _script(name: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 30):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _probe_services() -> dict[str, set[str]]:
    """role -> the gRPC health service names the rendered probes ask for."""
    names: dict[str, set[str]] = {}
    for variant in ("overlays/gpu", "base+mtls"):
        for r, c in containers(render(variant)):
            role = component(r)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe, {})
                if "grpc" in p:
                    names.setdefault(role, set()).add(p["grpc"].get("service", ""))
                elif "exec" in p and p["exec"]["command"][-1] != "health_probe.py":
                    cmd = p["exec"]["command"]
                    names.setdefault(role, set()).add(cmd[2] if len(cmd) > 2 else "")
    return names


def _health_probe(service: str, env: dict[str, str]) -> int:
    """deploy/base/files/health_probe.py in this process (a subprocess per call costs a
    second of imports): its exit code."""
    spec = importlib.util.spec_from_file_location("health_probe", SCRIPTS / "health_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        return module.main(["health_probe.py", service])


def test_probe_service_names_are_served(live):
    """The names the rendered probes ask for are SERVING on live services (under mTLS, through
    the exec probe of the mtls component); an unknown name and a client without a certificate
    are not."""
    names = _probe_services()
    assert names["prefill"] == {"", "tandem.v1.Prefill"}
    assert names["decode"] == {"", "tandem.v1.Decode"}
    for role in ("prefill", "decode"):
        port = live["grpc"][role].rsplit(":", 1)[1]
        env = {
            "TANDEM_GRPC_PORT": port,
            "TANDEM_ADVERTISE_ADDRESS": f"localhost:{port}",  # the name in the certificate
            **tls_env(live["pki"]),
        }
        # As the kubelet runs it: a script of its own (its name must not shadow a package).
        service = f"tandem.v1.{role.capitalize()}"
        result = _script("health_probe.py", service, env=env)
        assert result.returncode == 0, f"{role} {service!r}: {result.stderr}"
        for service in names[role]:
            assert _health_probe(service, env) == 0, f"{role} {service!r}"
        assert _health_probe("tandem.v1.Nothing", env) == 1
        no_certificate = {**env, **{k: "" for k in tls_env(live["pki"])}}
        assert _health_probe("", no_certificate) == 1
