from intervals import merge


def test_disjoint():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_overlapping():
    assert merge([(1, 4), (2, 3), (3, 8)]) == [(1, 8)]
