"""Packing algorithms against known optimal answers and brute force."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aspc.algorithms.packing import (bucket_for, choose_buckets, first_fit_decreasing, karmarkar_karp,
                                 micro_batches, packed_lengths, padding_report)


def test_first_fit_decreasing_known_answer():
    # 5+1, 4+2, 3+3, 2: FFD reaches the optimum of 4 bins here
    assert first_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 6) == [[0, 6], [1, 4], [2, 3], [5]]


def test_first_fit_decreasing_rejects_an_item_over_capacity():
    with pytest.raises(ValueError, match="exceeds the capacity"):
        first_fit_decreasing([7], 6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=40), st.integers(50, 120))
def test_first_fit_decreasing_packs_everything_within_capacity(lengths, capacity):
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # a first-fit packing has at most one bin that is at most half full
    fills = [sum(lengths[i] for i in b) for b in bins]
    assert sum(f * 2 <= capacity for f in fills) <= 1


def _first_fit_one_item_at_a_time(lengths, capacity):
    """The textbook first fit decreasing: every item, longest first (ties by index), scans the bins."""
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, room in enumerate(rooms) if room >= lengths[i]), len(bins))
        if k == len(bins):
            bins.append([])
            rooms.append(capacity)
        bins[k].append(i)
        rooms[k] -= lengths[i]
    return bins


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60).flatmap(lambda cap: st.tuples(st.lists(st.integers(1, cap), max_size=60), st.just(cap))))
def test_first_fit_decreasing_equals_the_textbook_algorithm(case):
    lengths, capacity = case  # built bin by bin, it must give exactly the same bins, in the same order
    assert first_fit_decreasing(lengths, capacity) == _first_fit_one_item_at_a_time(lengths, capacity)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60).flatmap(lambda cap: st.tuples(st.lists(st.integers(1, cap), max_size=60), st.just(cap))))
def test_packed_lengths_are_the_first_fit_bins_lengths(case):
    lengths, capacity = case  # the simulator's index-free packing: the same bins, members in the same order
    expected = [[lengths[i] for i in b] for b in _first_fit_one_item_at_a_time(lengths, capacity)]
    assert packed_lengths(lengths, capacity) == expected


def test_packed_lengths_rejects_an_item_over_capacity():
    with pytest.raises(ValueError, match="exceeds the capacity"):
        packed_lengths([3, 7], 6)


@pytest.mark.parametrize("weights, parts, best_spread", [
    ([3, 1, 1, 2, 2, 1], 2, 0),            # 5 | 5
    ([4, 5, 6, 7, 8], 2, 2),               # LDM gives 16 | 14 (optimum 15 | 15)
    ([10, 10, 10, 10], 4, 0),
    ([9, 8, 7, 6, 5, 4, 3, 2, 1], 3, 0),   # 15 | 15 | 15
])
def test_karmarkar_karp_known_answers(weights, parts, best_spread):
    result = karmarkar_karp(weights, parts)
    sums = [sum(weights[i] for i in p) for p in result]
    assert max(sums) - min(sums) == best_spread


def _brute_force_spread(weights, parts):
    best = None
    for assignment in itertools.product(range(parts), repeat=len(weights)):
        sums = [0] * parts
        for w, p in zip(weights, assignment):
            sums[p] += w
        spread = max(sums) - min(sums)
        best = spread if best is None else min(best, spread)
    return best


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(2, 3))
def test_karmarkar_karp_is_a_partition_and_close_to_optimal(weights, parts):
    result = karmarkar_karp(weights, parts)
    assert len(result) == parts
    assert sorted(i for p in result for i in p) == list(range(len(weights)))
    sums = [sum(weights[i] for i in p) for p in result]
    assert max(sums) - min(sums) <= _brute_force_spread(weights, parts) + max(weights)


def _brute_force_padding(fills, count, cap, align):
    sizes = sorted({min(cap, -(-f // align) * align) for f in fills} | {cap})
    best = None
    for k in range(1, count + 1):
        for chosen in itertools.combinations(sizes[:-1], k - 1):
            buckets = tuple(chosen) + (cap,)
            pad = sum(bucket_for(f, buckets) - f for f in fills)
            best = pad if best is None else min(best, pad)
    return best


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 1024), min_size=1, max_size=30), st.integers(1, 4))
def test_choose_buckets_is_optimal(fills, count):
    buckets = choose_buckets(fills, count, 1024, align=64)
    assert buckets[-1] == 1024 and len(buckets) <= count
    padding = sum(bucket_for(f, buckets) - f for f in fills)
    assert padding == _brute_force_padding(fills, count, 1024, 64)


def test_micro_batches_balance_ranks_and_respect_the_budget():
    lengths = [100 * (i % 7 + 1) for i in range(60)]
    ranks = micro_batches(lengths, tokens=1000, ranks=4)
    totals = [sum(sum(mb) for mb in rank) for rank in ranks]
    assert sum(totals) == sum(lengths)
    assert max(totals) - min(totals) <= max(lengths)
    assert all(sum(mb) <= 1000 for rank in ranks for mb in rank)


def test_padding_report_orders_the_strategies_on_a_long_tail():
    lengths = ([50] * 9 + [1000]) * 10  # arrival order: a long one now and then
    report = padding_report(lengths, tokens=2048, longest=1024, buckets=(512, 1024, 1536, 2048))
    assert report.pad_to_max > report.pad_to_longest > report.packed_buckets >= 0
