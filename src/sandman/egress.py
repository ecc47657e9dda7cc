"""Egress rules: where a sandbox with ``network=Egress(...)`` may connect.

``Egress(allow=[...], deny=[...])``: each rule is a CIDR (``"203.0.113.0/24"``, an
address alone is its /32 or /128, IPv6 too), a domain (``"pypi.org"``: that name only)
or a wildcard (``"*.pythonhosted.org"``: every name under it, not the name itself).

- ``allow=None`` (the default): anywhere but ``deny``; ``network="egress"`` is
  ``Egress()``. A list, even an empty one: only there. ``Egress(allow=[])`` closes
  the network (``sb.set_egress(Egress(allow=[]))`` after installing the dependencies).
- ``deny`` always wins over ``allow``.
- Whatever ``allow`` says, the provider's walls stay: cloud metadata (link-local),
  private ranges, the host, other sandboxes, the cluster (docs/security.md).
- A domain is admitted by its addresses as the provider's resolver answers them: the
  sandbox must look names up there (the ``nameserver`` in its ``/etc/resolv.conf``);
  other resolvers (ports 53 and 853) are reachable only when a CIDR allows them.

The rules are checked here, with a `ConfigError` naming the bad one.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from sandman import errors

__all__ = ["MAX_RULES", "Egress", "Rule", "parse_rule"]

MAX_RULES = 256
"""The most rules in ``allow`` and in ``deny`` (each)."""

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Rule(BaseModel):
    """One parsed rule: a ``cidr``, a ``domain`` (exact name) or a ``suffix`` (``*.name``:
    the names under ``value``)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cidr", "domain", "suffix"]
    value: str
    """The CIDR in its canonical form, or the domain in lower case without the ``*.``."""

    def network(self) -> Network:
        """The CIDR's network (kind ``cidr`` only)."""
        return ipaddress.ip_network(self.value)

    def matches(self, name: str) -> bool:
        """Whether the DNS ``name`` (lower case, no trailing dot) falls under this rule."""
        if self.kind == "domain":
            return name == self.value
        return self.kind == "suffix" and name.endswith("." + self.value)


def parse_rule(text: str) -> Rule:
    """``text`` as a `Rule`; ValueError saying what is wrong with it."""
    if not isinstance(text, str):
        raise ValueError(  # noqa: TRY004 (pydantic reports ValueError, not TypeError)
            f"an egress rule is a string (CIDR or domain), not {type(text).__name__}"
        )
    rule = text.strip().lower()
    if not rule:
        raise ValueError("an egress rule is empty")
    if "/" in rule or ":" in rule or re.fullmatch(r"[0-9.]+", rule):
        try:
            network = ipaddress.ip_network(rule, strict=True)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not a CIDR: {exc}") from None
        return Rule(kind="cidr", value=str(network))
    wildcard = rule.startswith("*.")
    name = rule.removeprefix("*.").removesuffix(".")
    labels = name.split(".")
    if (
        len(name) > 253
        or not all(_LABEL.fullmatch(label) for label in labels)
        or labels[-1].isdigit()
    ):
        raise ValueError(
            f"{text!r} is not a domain, a *.domain or a CIDR (labels of letters, digits, "
            "'-' and '_', at most 63 each, 253 in all; '*' only as the first label)"
        )
    return Rule(kind="suffix" if wildcard else "domain", value=name)


def _rules(values: Iterable[str], which: str) -> tuple[str, ...]:
    items = list(values)
    if len(items) > MAX_RULES:
        raise ValueError(f"{len(items)} {which} rules; at most {MAX_RULES}")
    kept: dict[str, None] = {}
    for item in items:
        rule = parse_rule(item)
        kept["*." + rule.value if rule.kind == "suffix" else rule.value] = None
    return tuple(kept)


class Egress(BaseModel):
    """Egress with rules: ``SandboxSpec(network=Egress(allow=["pypi.org",
    "*.pythonhosted.org"]))``. See the module docstring for what each rule means.

    A bad rule (not a CIDR or a domain, too many) is a `ConfigError` naming it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: tuple[str, ...] | None = None
    """Where it may go: None for anywhere (but ``deny``), a list for only there."""
    deny: tuple[str, ...] = ()
    """Where it may never go, whatever ``allow`` says."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            words = "; ".join(
                f"{'.'.join(map(str, e['loc']))} is not a field (allow, deny)"
                if e["type"] == "extra_forbidden"
                else str((e.get("ctx") or {}).get("error", e["msg"]))
                for e in exc.errors()
            )
            raise errors.ConfigError(f"invalid egress rules: {words}") from None

    @field_validator("allow", mode="before")
    @classmethod
    def _allow(cls, value: object) -> object:
        if value is None:
            return None
        return _rules(_strings(value, "allow"), "allow")

    @field_validator("deny", mode="before")
    @classmethod
    def _deny(cls, value: object) -> object:
        return _rules(_strings(value, "deny"), "deny")

    def rules(self, which: Literal["allow", "deny"]) -> list[Rule]:
        """The parsed rules of ``allow`` (none when it is None) or ``deny``."""
        return [parse_rule(item) for item in (getattr(self, which) or ())]

    @property
    def open(self) -> bool:
        """Anywhere (but ``deny``): ``allow`` is None."""
        return self.allow is None

    @property
    def domains(self) -> bool:
        """Whether any rule names a domain."""
        return any(r.kind != "cidr" for r in (*self.rules("allow"), *self.rules("deny")))


def _strings(value: object, which: str) -> list[str]:
    if isinstance(value, str):
        raise ValueError(f"{which} is a list of rules, not one string: [{value!r}]")  # noqa: TRY004
    if not isinstance(value, Iterable):
        raise ValueError(f"{which} is a list of rules, not {type(value).__name__}")  # noqa: TRY004
    return list(value)
