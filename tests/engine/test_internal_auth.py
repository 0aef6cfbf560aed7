"""`check_startup`: what refuses to start, with which message, and what only warns."""

from __future__ import annotations

import logging

import pytest

from engine import internal_auth
from engine.internal_auth import InternalAuthError, check_startup
from tests.fixtures.pki import make_pki, tls_env

_ALL_ENV = (
    internal_auth.ENV_TOKEN,
    internal_auth.ENV_TOKEN_FILE,
    internal_auth.ENV_TLS_CERT,
    internal_auth.ENV_TLS_KEY,
    internal_auth.ENV_TLS_CA,
)


@pytest.fixture
def env(monkeypatch):
    """No internal-auth variable set (the session's test token removed)."""
    for name in _ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_no_token_refuses_with_the_fix(env):
    with pytest.raises(InternalAuthError) as e:
        check_startup(insecure=False)
    message = str(e.value)
    assert message.startswith("refusing to start: internal gRPC would be unauthenticated")
    assert internal_auth.ENV_TOKEN_FILE in message and "--insecure-internal" in message
    assert "\n" not in message


def test_insecure_internal_starts_with_a_loud_warning(env, caplog):
    with caplog.at_level(logging.WARNING, logger=internal_auth.__name__):
        check_startup(insecure=True)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "INTERNAL gRPC IS UNAUTHENTICATED" in record.getMessage()


def test_token_from_env_or_file_starts_quietly(env, tmp_path, caplog):
    env.setenv(internal_auth.ENV_TOKEN, "a" * 16)
    check_startup(insecure=False)
    env.delenv(internal_auth.ENV_TOKEN)
    secret = tmp_path / "token"
    secret.write_text("b" * 64 + "\n")  # a trailing newline, as `echo` writes it
    env.setenv(internal_auth.ENV_TOKEN_FILE, str(secret))
    check_startup(insecure=False)
    assert internal_auth.internal_token() == "b" * 64
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("token", ["short", "a" * 15])
def test_weak_token_is_refused(env, token):
    env.setenv(internal_auth.ENV_TOKEN, token)
    with pytest.raises(InternalAuthError, match=rf"too weak \({len(token)} characters\); use at"):
        check_startup(insecure=True)  # --insecure-internal does not excuse a bad token


@pytest.mark.parametrize("token", ["sixteen chars \u00e9\u00e9", "x" * 20 + "\n1"])
def test_token_grpc_metadata_cannot_carry_is_refused(env, token):
    env.setenv(internal_auth.ENV_TOKEN, token)
    with pytest.raises(InternalAuthError, match="characters other than printable ASCII"):
        check_startup(insecure=False)


def test_unreadable_or_empty_token_file_is_refused(env, tmp_path):
    env.setenv(internal_auth.ENV_TOKEN_FILE, str(tmp_path / "absent"))
    with pytest.raises(InternalAuthError, match=r"absent cannot be read \(No such file"):
        check_startup(insecure=False)
    (tmp_path / "empty").write_text("\n")
    env.setenv(internal_auth.ENV_TOKEN_FILE, str(tmp_path / "empty"))
    with pytest.raises(InternalAuthError, match="empty is empty; put the shared internal token"):
        check_startup(insecure=False)


def test_tls_needs_all_three_files(env, pki):
    env.setenv(internal_auth.ENV_TOKEN, "a" * 32)
    env.setenv(internal_auth.ENV_TLS_CERT, tls_env(pki)[internal_auth.ENV_TLS_CERT])
    with pytest.raises(InternalAuthError, match="TLS_KEY and TANDEM_INTERNAL_TLS_CA are unset"):
        check_startup(insecure=False)


def test_tls_key_of_another_certificate_is_refused(env, pki):
    for name, value in tls_env(pki).items():
        env.setenv(name, value)
    env.setenv(internal_auth.ENV_TLS_KEY, str(pki / "rogue.key"))
    with pytest.raises(InternalAuthError, match="not a PEM certificate and its private key"):
        check_startup(insecure=False)


def test_mtls_alone_authenticates(env, pki, caplog):
    for name, value in tls_env(pki).items():
        env.setenv(name, value)
    with caplog.at_level(logging.INFO, logger=internal_auth.__name__):
        check_startup(insecure=False)
    assert "authenticated by mTLS only" in caplog.text
