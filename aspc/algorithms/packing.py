"""Packing algorithms: balance sequences across data-parallel ranks, pack them into token-budget
micro-batches, and choose the static shape buckets a graph-mode executor compiles once each.
Pure functions over lengths; the pack pass and the runtimes share them."""
from __future__ import annotations

import bisect
import heapq
from collections import defaultdict, deque
from dataclasses import dataclass
from operator import itemgetter


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bin packing: indices of `lengths` grouped into bins of total <= capacity, longest first,
    each into the first bin with room (ties by index): `packed_lengths`' bins, each length given
    back its index. Equal lengths are scanned in index order and the bins are built one after
    another, so among equal lengths each bin takes the lowest indices the bins before it left."""
    indices: dict[int, deque[int]] = defaultdict(deque)
    for index, length in enumerate(lengths):
        indices[length].append(index)
    return [[indices[length].popleft() for length in lengths_of_bin]
            for lengths_of_bin in packed_lengths(lengths, capacity)]


def packed_lengths(lengths: list[int], capacity: int) -> list[list[int]]:
    """First fit decreasing on lengths alone: bins of total <= capacity, each the lengths it holds
    in the order it took them (the simulated learner packs every step's samples: no indices).

    Built bin by bin, which gives the same bins: under first fit, bin k takes an item exactly when
    the item fits beside what bin k took of the items before it, so bin k is a greedy scan of the
    items bins 1..k-1 left, longest first. In that scan the next item that fits is the first one
    at most the room left (lengths only fall), found by bisection: O(log n) per item in C, where a
    search tree over the bins costs a Python loop per level."""
    keys = sorted([-length for length in lengths])  # ascending, as bisect wants: the longest first
    if keys and -keys[0] > capacity:
        raise ValueError(f"item of length {-keys[0]} exceeds the capacity {capacity}")
    bins: list[list[int]] = []
    while keys:
        room, position, members = capacity, 0, []
        while (position := bisect.bisect_left(keys, -room, position)) < len(keys):  # the first left <= room
            length = -keys.pop(position)
            members.append(length)
            room -= length
        bins.append(members)
    return bins


def karmarkar_karp(weights: list[int], parts: int) -> list[list[int]]:
    """Multi-way largest differencing: indices split into `parts` sets of near-equal weight sums.

    A partial partition is `parts` subsets sorted by sum, largest first; the two partitions of
    largest spread merge by pairing one's largest subset with the other's smallest. Subsets are
    kept as trees of merged members, flattened once at the end."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    if not weights:
        return [[] for _ in range(parts)]
    empty = [(0, ())] * (parts - 1)
    heap = [(-w, i, [(w, i)] + empty) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted([(sa + sb, mb if ma == () else ma if mb == () else (ma, mb))  # joined trees, no call each
                         for (sa, ma), (sb, mb) in zip(a, reversed(b))],
                        key=itemgetter(0), reverse=True)  # stable: equal sums keep their order
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], counter, merged))
        counter += 1
    return [sorted(_members(tree)) for _, tree in heap[0][2]]


def _members(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, int):
            out.append(node)
        elif node:
            stack.extend(node)
    return out


def choose_buckets(fills: list[int], count: int, cap: int, align: int = 64) -> tuple[int, ...]:
    """At most `count` bucket sizes (the largest is `cap`) minimising the padding of `fills`,
    each fill padded to the smallest bucket that holds it. Optimal 1-D partition by dynamic
    programming over the aligned distinct fill sizes."""
    if count < 1:
        raise ValueError("count must be >= 1")
    sizes = sorted({min(cap, -(-f // align) * align) for f in fills} | {cap})
    weight = {s: 0 for s in sizes}
    for f in fills:
        weight[min(cap, -(-f // align) * align)] += 1
    n = len(sizes)
    # cost(i, j): pad every size in sizes[i..j] up to sizes[j]
    prefix_w, prefix_ws = [0], [0]
    for s in sizes:
        prefix_w.append(prefix_w[-1] + weight[s])
        prefix_ws.append(prefix_ws[-1] + weight[s] * s)

    def cost(i: int, j: int) -> int:
        return sizes[j] * (prefix_w[j + 1] - prefix_w[i]) - (prefix_ws[j + 1] - prefix_ws[i])

    inf = float("inf")
    best = [[inf] * n for _ in range(min(count, n) + 1)]
    choice = [[-1] * n for _ in range(min(count, n) + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for k in range(2, min(count, n) + 1):
        for j in range(n):
            for i in range(j):
                candidate = best[k - 1][i] + cost(i + 1, j)
                if candidate < best[k][j]:
                    best[k][j], choice[k][j] = candidate, i
    k = min(range(1, min(count, n) + 1), key=lambda k: (best[k][n - 1], k))
    chosen, j = [], n - 1
    while k >= 1 and j >= 0:
        chosen.append(sizes[j])
        j, k = choice[k][j], k - 1
    return tuple(sorted(chosen))


def bucket_for(fill: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= fill)


@dataclass(frozen=True)
class PaddingReport:
    """Share of processed tokens that are padding, under four ways to form micro-batches."""

    pad_to_max: float  # every sequence padded to max_prompt + max_response
    pad_to_longest: float  # fixed-count micro-batches (tokens / mean length samples) padded to their longest
    packed_buckets: float  # packed by token budget, padded to the chosen static buckets


def micro_batches(lengths: list[int], tokens: int, ranks: int) -> list[list[list[int]]]:
    """Per data-parallel rank, its micro-batches (lists of sequence lengths): KK across ranks,
    then first-fit-decreasing into token-budget micro-batches within each rank."""
    result = []
    for rank in karmarkar_karp(lengths, ranks):
        result.append(packed_lengths([lengths[i] for i in rank], tokens))
    return result


def padding_report(lengths: list[int], tokens: int, longest: int, buckets: tuple[int, ...],
                   ranks: int = 1, unit: int | None = None) -> PaddingReport:
    """Padding of `lengths` packed in units of `unit` sequences (a streamed stage's units; None:
    all of them at once), each unit on its own, as the runtime packs what it is given."""
    units = [lengths[i:i + unit] for i in range(0, len(lengths), unit)] if unit else [lengths]
    useful = sum(lengths)
    # the classic way: a fixed sample count per micro-batch, the budget's worth on average
    per_batch = max(1, round(tokens * len(lengths) / useful))
    to_longest = sum(len(b) * max(b) for u in units for b in (u[i:i + per_batch] for i in range(0, len(u), per_batch)))
    fills = [sum(mb) for u in units for rank in micro_batches(u, tokens, ranks) for mb in rank]
    with_buckets = sum(bucket_for(f, buckets) for f in fills)
    return PaddingReport(
        pad_to_max=1 - useful / (len(lengths) * longest),
        pad_to_longest=1 - useful / to_longest,
        packed_buckets=1 - useful / with_buckets,
    )
