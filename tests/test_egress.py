"""`Egress` rules: what each rule means, and a clear `ConfigError` for a bad one."""

from __future__ import annotations

import pytest

from sandman import errors
from sandman.egress import MAX_RULES, Egress, parse_rule
from sandman.models import SandboxSpec


def test_rules_are_parsed_and_canonical() -> None:
    rules = Egress(allow=["PyPI.org", "*.Files.test", "10.0.0.1", "2001:db8::/32"], deny=["x.test"])
    assert rules.allow == ("pypi.org", "*.files.test", "10.0.0.1/32", "2001:db8::/32")
    assert [r.kind for r in rules.rules("allow")] == ["domain", "suffix", "cidr", "cidr"]
    assert parse_rule("*.files.test").matches("a.files.test")
    assert not parse_rule("*.files.test").matches("files.test")  # under it, not itself
    assert not parse_rule("pypi.org").matches("evil.pypi.org")
    assert Egress().open and not Egress(allow=[]).open


@pytest.mark.parametrize(
    ("rules", "words"),
    [
        ({"allow": ["a b"]}, "'a b' is not a domain"),
        ({"allow": ["10.0.0.1/8"]}, "has host bits set"),
        ({"deny": ["1.2.3"]}, "'1.2.3' is not a CIDR"),
        ({"allow": ["*"]}, "'*' is not a domain"),
        ({"allow": ["a.*.test"]}, "is not a domain"),
        ({"allow": ["-x.test"]}, "is not a domain"),
        ({"allow": ["x" * 64 + ".test"]}, "is not a domain"),
        ({"allow": "pypi.org"}, "a list of rules, not one string"),
        ({"allow": [f"10.0.{i // 256}.{i % 256}" for i in range(MAX_RULES + 1)]}, "at most"),
        ({"allow": [], "what": 1}, "what is not a field"),
    ],
)
def test_a_bad_rule_is_a_clear_config_error(rules: dict[str, object], words: str) -> None:
    with pytest.raises(errors.ConfigError, match="invalid egress rules") as caught:
        Egress(**rules)
    assert words in str(caught.value)


def test_a_spec_carries_rules_through_json() -> None:
    spec = SandboxSpec(image="x", network={"allow": ["pypi.org"], "deny": ["1.2.3.4"]})
    assert spec.network_mode == "egress" and spec.egress == Egress(
        allow=["pypi.org"], deny=["1.2.3.4"]
    )
    assert SandboxSpec.model_validate_json(spec.model_dump_json()) == spec
    assert SandboxSpec(image="x", network="egress").egress == Egress()
    assert SandboxSpec(image="x").egress is None
