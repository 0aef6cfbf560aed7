"""Service flags that need no process: where UCX may listen (`--kv-interface`)."""

from __future__ import annotations

import socket

import pytest

from decode_svc.server import build_parser
from engine.service_main import ENV_KV_INTERFACE, kv_net_devices


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_ucx_stays_on_loopback_when_the_service_does(host):
    assert kv_net_devices(host, None) == "lo"


def test_kv_interface_is_given_to_ucx_as_named():
    iface = socket.if_nameindex()[0][1]
    assert kv_net_devices("0.0.0.0", iface) == iface
    assert kv_net_devices("127.0.0.1", f"{iface},mlx5_0:1") == f"{iface},mlx5_0:1"


def test_unknown_kv_interface_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"no network interface 'nosuch0' \(it has lo"):
        kv_net_devices("0.0.0.0", "nosuch0")


def test_all_interfaces_only_for_an_exposed_service_with_a_warning(caplog):
    assert kv_net_devices("0.0.0.0", None) is None
    assert "--kv-interface" in caplog.text and ENV_KV_INTERFACE in caplog.text


def test_kv_interface_defaults_to_its_environment_variable(monkeypatch):
    monkeypatch.setenv(ENV_KV_INTERFACE, "eth7")
    args = build_parser().parse_args(["model"])
    assert args.kv_interface == "eth7" and not args.insecure_internal
    assert build_parser().parse_args(["m", "--kv-interface", "lo"]).kv_interface == "lo"
