"""Rank 0's choice of DP group: the longest mirrored match, unless loads are imbalanced or nothing matches enough."""

from __future__ import annotations

from moeplex.ranks.dp_dispatch import BALANCE_ABS_THRESHOLD, DPDispatch

PREFIX = [256] + list(range(1, 64))


def test_a_prompt_follows_the_group_that_will_cache_its_prefix_and_forgets_after_a_flush():
    dispatch = DPDispatch(3, 4096, cache_aware=True)
    assert dispatch.choose(PREFIX + [1], [0, 0, 0], [0, 0, 0]) == 0  # nothing seen: the least loaded
    dispatch.will_cache(2, PREFIX + [1])
    assert dispatch.choose(PREFIX + [7, 7], [1, 0, 3], [9, 0, 90]) == 2  # a long match beats the lighter groups
    assert dispatch.choose([256, 5, 5, 5], [1, 0, 3], [9, 0, 90]) == 1  # a match of 1 token in 3: the least loaded
    dispatch.will_cache(1, PREFIX + [1, 2])
    assert dispatch.choose(PREFIX + [1, 2, 3], [0, 2, 0], [0, 20, 0]) == 1  # the longest of two matches
    assert dispatch.choose(PREFIX + [9], [1, 2, 0], [5, 20, 0]) == 2  # equal matches: the fewest requests
    dispatch.forget()
    assert dispatch.choose(PREFIX + [1, 2, 3], [0, 2, 0], [0, 20, 0]) == 0
    assert dispatch.reasons == {"cache_hit": 3, "cache_miss": 3, "imbalanced": 0}


def test_imbalanced_loads_go_to_the_least_loaded_group_whatever_it_matched():
    dispatch = DPDispatch(2, 4096, cache_aware=True)
    dispatch.will_cache(0, PREFIX)
    many = BALANCE_ABS_THRESHOLD + 1
    assert dispatch.choose(PREFIX + [1], [many, 0], [many * 10, 0]) == 1
    assert dispatch.choose(PREFIX + [1], [many + 1, 1], [many * 10, 10]) == 1
    assert dispatch.choose(PREFIX + [1], [many - 1, 0], [many * 10, 0]) == 0  # within the threshold: the match wins
    assert dispatch.reasons["imbalanced"] == 2


def test_without_the_cache_or_with_one_group_no_mirror_is_kept():
    for dispatch in (DPDispatch(2, 4096, cache_aware=False), DPDispatch(1, 4096, cache_aware=True)):
        dispatch.will_cache(0, PREFIX)
        assert dispatch.tree is None
        assert dispatch.choose(PREFIX + [1], [3] * dispatch.dp_size, [30, 10][: dispatch.dp_size]) == dispatch.dp_size - 1
