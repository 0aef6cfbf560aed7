"""The PrometheusRule's rules pass `promtool check rules`, and `promtool test rules` runs one
unit test per alert (deploy/components/monitoring/tests/); every alert has a runbook."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings

import pytest
import yaml

from tests.deploy.manifests import DEPLOY, ROOT

MONITORING = DEPLOY / "components" / "monitoring"
RULES_FILE = "tandem-rules.yaml"  # the name the unit-test file loads


def _rule_groups() -> dict:
    doc = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return doc["spec"]


def _alerts() -> list[str]:
    return [r["alert"] for g in _rule_groups()["groups"] for r in g["rules"] if "alert" in r]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        reason = (
            "promtool is not installed (Debian package prometheus; scripts/test.sh installs it)"
        )
        warnings.warn(reason, stacklevel=2)  # shown in the summary, -q or not
        pytest.skip(reason)
    return promtool


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rules")
    (d / RULES_FILE).write_text(yaml.safe_dump(_rule_groups(), sort_keys=False))
    shutil.copy(MONITORING / "tests" / "tandem-rules.test.yaml", d)
    return d


def test_promtool_check_rules(rules_dir):
    result = subprocess.run(
        [_promtool(), "check", "rules", RULES_FILE],
        cwd=rules_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


def test_promtool_unit_tests(rules_dir):
    result = subprocess.run(
        [_promtool(), "test", "rules", "tandem-rules.test.yaml"],
        cwd=rules_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    tests = yaml.safe_load((MONITORING / "tests" / "tandem-rules.test.yaml").read_text())
    firing, quiet = set(), set()
    for t in tests["tests"]:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert set(_alerts()) == firing == quiet
    assert {
        "TandemRequestsWaitingHigh",
        "TandemPreemptionsHigh",
        "TandemKVCacheNearlyFull",
        "TandemTTFTHigh",
        "TandemITLHigh",
        "TandemPrefixCacheHitRatioDropped",
        "TandemRestarting",
        "TandemKVTransferFailures",
        "TandemRoutingDegraded",
    } <= firing


def test_every_alert_has_a_runbook():
    doc = (ROOT / "docs" / "operations.md").read_text()
    headings = set(re.findall(r"^#+\s+(\w+)\s*$", doc, re.MULTILINE))
    for group in _rule_groups()["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] in headings, (
                f"docs/operations.md has no runbook for {rule['alert']}"
            )
            anchor = rule["annotations"]["runbook"]
            assert anchor == f"docs/operations.md#{rule['alert'].lower()}"
