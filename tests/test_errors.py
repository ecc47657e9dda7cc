from __future__ import annotations

import pytest

import sandman
from sandman import errors
from sandman.daemon.protocol import ERROR_CLASSES, error_from_response


def test_every_error_is_a_sandbox_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), sandman.SandboxError)


def test_tree_in_docstring_names_every_error() -> None:
    assert errors.__doc__ is not None
    for name in errors.__all__:
        assert name in errors.__doc__, name


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_wire_codes_map_to_classes(code: str) -> None:
    body = b'{"error": {"code": "%s", "message": "m"}}' % code.encode()
    exc = error_from_response(418, body)
    assert type(exc) is ERROR_CLASSES[code]
    assert (exc.code, exc.status, exc.message) == (code, 418, "m")


def test_builtin_mixins() -> None:
    assert isinstance(error_from_response(404, b'{"error":{"code":"not_found","message":"x"}}'),
                      FileNotFoundError)  # fmt: skip
    assert issubclass(sandman.ExecTimeout, TimeoutError)
    assert issubclass(sandman.PermissionDenied, PermissionError)
    assert str(sandman.PathNotFound("gone", status=404)) == "gone [not_found]"


def test_unknown_code_and_garbage() -> None:
    exc = error_from_response(500, b'{"error": {"code": "brand_new", "message": "m"}}')
    assert type(exc) is sandman.DaemonError and exc.code == "brand_new"
    exc = error_from_response(502, b"<html>bad gateway</html>")
    assert type(exc) is sandman.DaemonError and "bad gateway" in exc.message


def test_retryable() -> None:
    assert sandman.DaemonUnavailable("x").retryable
    assert sandman.CapacityError().retryable
    assert not sandman.ImageError().retryable
