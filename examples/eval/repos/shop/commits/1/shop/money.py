"""Amounts of money, held as whole cents."""


def format_cents(cents):
    """An amount of cents as a price with two decimals: 1234 -> "12.34"."""
    return f"{cents // 100}.{cents % 100}"
