"""Mean and median of a list of numbers."""


def mean(values):
    """The arithmetic mean; ValueError for an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """The middle value of the sorted list; ValueError for an empty list."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle]
