"""The NetworkPolicy of a sandbox's egress rules, read as a network plugin would."""

from __future__ import annotations

from typing import Any

import pytest

from sandman import errors
from sandman.egress import Egress
from sandman.models import SandboxSpec
from sandman.providers.kubernetes import egress

POD = {"metadata": {"name": "sb-1", "uid": "u-1"}}


def _blocks(rules: Egress) -> list[dict[str, Any]]:
    return [
        to["ipBlock"]
        for rule in egress.policy(POD, rules)["spec"]["egress"]
        for to in rule["to"]
        if "ipBlock" in to
    ]


def test_deny_is_cut_out_of_what_is_allowed_and_walls_stay() -> None:
    assert _blocks(Egress(allow=["203.0.113.0/24"], deny=["203.0.113.7"])) == [
        {"cidr": "203.0.113.0/24", "except": ["203.0.113.7/32"]}
    ]
    assert _blocks(Egress(allow=["10.1.0.0/16", "169.254.169.254"])) == []  # inside walls
    assert _blocks(Egress(allow=["203.0.113.0/24"], deny=["203.0.0.0/16"])) == []
    anywhere = _blocks(Egress(deny=["198.51.100.0/24"]))
    assert anywhere[0]["cidr"] == "0.0.0.0/0" and "198.51.100.0/24" in anywhere[0]["except"]
    assert "169.254.0.0/16" in anywhere[0]["except"] and anywhere[1]["cidr"] == "::/0"


def test_the_policy_selects_its_pod_alone_and_belongs_to_it() -> None:
    body = egress.policy(POD, Egress(allow=["203.0.113.0/24"]))
    assert body["spec"]["podSelector"] == {"matchLabels": {"sandman.io/sandbox": "sb-1"}}
    assert body["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert all("ports" not in rule for rule in body["spec"]["egress"])  # no cluster DNS


def test_labels_and_domains() -> None:
    assert egress.pod_labels("sb-1", SandboxSpec(image="x", network="egress")) == {
        "sandman.io/egress": "allow"
    }
    ruled = SandboxSpec(image="x", network=Egress(allow=[]))
    assert egress.pod_labels("sb-1", ruled) == {
        "sandman.io/egress": "rules",
        "sandman.io/sandbox": "sb-1",
    }
    assert egress.pod_labels("sb-1", SandboxSpec(image="x")) == {}
    with pytest.raises(errors.ConfigError, match="only CIDRs"):
        egress.pod_labels("sb-1", SandboxSpec(image="x", network=Egress(deny=["evil.test"])))
