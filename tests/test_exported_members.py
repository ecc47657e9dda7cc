"""The public surface is exactly `__all__`, and everything in it is documented."""

from __future__ import annotations

import inspect

import sandman


def test_all_names_exist_and_are_sorted() -> None:
    for name in sandman.__all__:
        assert hasattr(sandman, name), name
    assert sandman.__all__ == sorted(sandman.__all__)


def test_public_names_have_docstrings() -> None:
    for name in sandman.__all__:
        member = getattr(sandman, name)
        if inspect.isclass(member) or inspect.isfunction(member):
            assert member.__doc__, name


def test_public_client_methods_have_docstrings() -> None:
    # The sandbox faces take theirs from these (tests/client/test_local.py).
    for name, member in inspect.getmembers(sandman.DaemonClient, inspect.isfunction):
        if not name.startswith("_"):
            assert member.__doc__, name
