"""The local provider: one crun (or runc) container per sandbox, on an overlayfs root."""

from sandman.providers.local.provider import LocalProvider

__all__ = ["LocalProvider"]
