"""`ServerSettings.from_env` and ``sandman serve``'s refusals: clear errors, before serving."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sandman.cli import build
from sandman.errors import ConfigError
from sandman.server import ServerSettings, TenantLimits

KEY = "a-key-of-sixteen-chars"


def test_settings_from_sandman_variables_and_overrides() -> None:
    environ = {
        "SANDMAN_API_KEYS": f"team-a:{KEY}, team-b:{KEY}-b",
        "SANDMAN_MAX_LEASE": "120",
        "SANDMAN_RELEASE_ON_SHUTDOWN": "false",
        "SANDMAN_TENANT_LIMITS": '{"team-a": {"max_sandboxes": 4}}',
        "SANDMAN_URL": "http://ignored",  # the client's, not a setting
    }
    settings = ServerSettings.from_env(environ, max_lease=None, anonymous_tenant="solo")
    assert [k.tenant for k in settings.api_keys] == ["team-a", "team-b"]
    assert settings.max_lease == 120.0 and settings.release_on_shutdown is False
    assert settings.limits("team-a") == TenantLimits(max_sandboxes=4)
    assert settings.anonymous_tenant == "solo"
    assert ServerSettings.from_env(environ, release_on_shutdown=True).release_on_shutdown


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SANDMAN_API_KEYS", "no-colon", "tenant:key"),
        ("SANDMAN_API_KEYS", "a:short", "at least 16"),
        ("SANDMAN_MAX_LEASE", "-1", "max_lease"),
        ("SANDMAN_TENANT_LIMITS", "{not json", "not JSON"),
    ],
)
def test_bad_variables_are_one_clear_error(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerSettings.from_env({name: value})


def test_serve_refuses_to_start_without_keys_or_with_bad_ones() -> None:
    runner = CliRunner()
    bare = runner.invoke(build(), ["serve", "--port", "9"], env={"SANDMAN_API_KEYS": ""})
    assert bare.exit_code == 1 and bare.output.startswith("error: no API keys")
    bad = runner.invoke(build(), ["serve"], env={"SANDMAN_API_KEYS": "x"})
    assert bad.exit_code == 1 and "tenant:key" in bad.output
    kube = runner.invoke(
        build(), ["serve", "--provider", "kubernetes"],
        env={"SANDMAN_API_KEYS": f"a:{KEY}", "SANDMAN_KUBERNETES": '{"bogus": 1}'},
    )  # fmt: skip
    assert kube.exit_code == 1 and "SANDMAN_KUBERNETES: bogus" in kube.output
