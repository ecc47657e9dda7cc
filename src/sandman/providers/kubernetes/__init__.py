"""The Kubernetes provider: one pod per sandbox (see `KubernetesProvider`)."""

from sandman.providers.kubernetes.provider import KubernetesProvider

__all__ = ["KubernetesProvider"]
