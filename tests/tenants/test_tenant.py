"""Tenants: credentials resolved by variable name at send time, never recorded."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.tenants.tenant import Tenant, default_tenants

SECRET = "sk-planted-0123456789abcdef"


def test_auth_headers_resolve_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tenant = Tenant(name="acme", api_key_env="KVC_ACME_KEY")
    monkeypatch.setenv("KVC_ACME_KEY", "first")
    assert tenant.auth_headers() == {"Authorization": "Bearer first"}
    monkeypatch.setenv("KVC_ACME_KEY", "rotated")
    assert tenant.auth_headers() == {"Authorization": "Bearer rotated"}
    assert tenant.auth_headers({"KVC_ACME_KEY": "given"}) == {"Authorization": "Bearer given"}


def test_header_values_may_reference_the_environment() -> None:
    tenant = Tenant(name="acme", headers={"api-key": "${KVC_AZ}", "X-Team": "t-${KVC_TEAM}"})
    headers = tenant.auth_headers({"KVC_AZ": SECRET, "KVC_TEAM": "7"})
    assert headers == {"api-key": SECRET, "X-Team": "t-7"}


@pytest.mark.parametrize("environ", [{}, {"KVC_ACME_KEY": ""}])
def test_missing_credential_names_the_variable(environ: dict[str, str]) -> None:
    tenant = Tenant(name="acme", api_key_env="KVC_ACME_KEY")
    with pytest.raises(ConfigError, match=r"acme.*KVC_ACME_KEY"):
        tenant.auth_headers(environ)
    with pytest.raises(ConfigError, match="KVC_MISSING"):
        Tenant(name="acme", headers={"api-key": "${KVC_MISSING}"}).auth_headers(environ)


def test_record_never_holds_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_ACME_KEY", SECRET)
    monkeypatch.setenv("KVC_AZ", SECRET + "-header")
    tenant = Tenant(
        name="acme",
        api_key_env="KVC_ACME_KEY",
        headers={"api-key": "${KVC_AZ}", "X-Literal": "literal-value-9"},
        cache_salt="salt-value-7",
        weight=2.5,
    )
    assert SECRET in tenant.auth_headers()["Authorization"]  # the secret is really there
    text = json.dumps(tenant.to_record())
    for value in (SECRET, "literal-value-9", "salt-value-7", "KVC_AZ"):
        assert value not in text
    assert tenant.to_record() == {
        "name": "acme",
        "api_key_env": "KVC_ACME_KEY",
        "header_names": ["X-Literal", "api-key"],
        "has_cache_salt": True,
        "weight": 2.5,
    }


def test_a_key_pasted_as_the_variable_name_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match="NAME of an environment variable") as info:
        Tenant(name="acme", api_key_env=SECRET)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "tenant name"),
        ({"name": "has space"}, "tenant name"),
        ({"name": "a", "weight": 0.0}, "weight"),
        ({"name": "a", "weight": float("nan")}, "weight"),
        ({"name": "a", "headers": {"bad header": "x"}}, "header name"),
        ({"name": "a", "api_key_env": "K", "headers": {"authorization": "x"}}, "not both"),
    ],
)
def test_invalid_tenants_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Tenant(**kwargs)  # type: ignore[arg-type]


def test_tenants_keep_their_own_headers_and_pickle() -> None:
    given = {"X-A": "1"}
    tenant = Tenant(name="a", api_key_env="KVC_A", headers=given, weight=2.0)
    given["X-B"] = "2"
    assert dict(tenant.headers) == {"X-A": "1"}
    assert pickle.loads(pickle.dumps(tenant)) == tenant
    assert dataclasses.asdict(tenant)["headers"] == {"X-A": "1"}


def test_default_tenants() -> None:
    tenants = default_tenants(3, api_key_env="KVC_SHARED")
    assert [t.name for t in tenants] == ["tenant-0", "tenant-1", "tenant-2"]
    assert {t.api_key_env for t in tenants} == {"KVC_SHARED"}
    assert len(default_tenants()) == 4
    with pytest.raises(ConfigError, match="at least 1"):
        default_tenants(0)
