"""Small statistics helpers."""

from calc.stats import mean, median

__all__ = ["mean", "median"]
