"""The ngram drafter's lookup against a brute-force search over every suffix length and position."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from moeplex.plugins.drafters.ngram import lookup


def brute(ids: list[int], max_n: int, min_n: int, count: int) -> list[int]:
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[-n:]
        for end in range(len(ids) - 2, n - 2, -1):  # the occurrence ids[end-n+1 .. end], latest first
            if ids[end - n + 1 : end + 1] == suffix:
                return ids[end + 1 : end + 1 + count]
    return []


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.integers(1, 5), st.integers(1, 3), st.integers(1, 4))
def test_lookup_equals_brute_force(ids, max_n, min_n, count):
    assert lookup(np.asarray(ids, dtype=np.int64), max_n, min_n, count) == brute(ids, max_n, min_n, count)
