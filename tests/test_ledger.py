"""The simulator's ledger books a generation instance's segments at once and makes their spans only
when read; the instances' busy intervals are merged in one pass when booked in time order."""
from hypothesis import given, settings
from hypothesis import strategies as st

from aspc.accounting.ledger import Ledger, Span, merge
from aspc.drivers.sim.result import _busy

segment = st.tuples(st.integers(0, 50), st.integers(0, 8), st.sampled_from(["useful", "tail", "sync"]))


def test_deferred_segments_are_booked_at_once_and_become_spans_in_their_place():
    ledger = Ledger()
    ledger.span("learner", 0.0, 1.0, "useful", "train", 2)
    booked = ledger.segments("gen[0]", [(0.0, 2.0, "useful"), (2.0, 3.0, "tail"), (4.0, 9.0, "useful")], 5.0, 4)
    assert booked == 2 + 1 + 1  # seconds per device, cut at `until`: the instance's busy time
    ledger.span("gen[0]", 3.0, 4.0, "skewness", "idle: a peer still works", 4)
    assert dict(ledger.device_seconds) == {"useful": 2 + 8 + 4, "tail": 4, "skewness": 4}
    assert ledger.all_spans() == [Span("learner", 0.0, 1.0, "useful", "train"),
                                  Span("gen[0]", 0.0, 2.0, "useful", "useful"),
                                  Span("gen[0]", 2.0, 3.0, "tail", "tail"),
                                  Span("gen[0]", 4.0, 5.0, "useful", "useful"),  # cut at `until`
                                  Span("gen[0]", 3.0, 4.0, "skewness", "idle: a peer still works")]


@settings(max_examples=300, deadline=None)
@given(st.lists(segment, max_size=30), st.booleans(), st.integers(0, 60))
def test_busy_in_one_pass_equals_merge(raw, in_order, wall):
    segments = [(float(a), float(a + d), c) for a, d, c in raw]
    if in_order:
        segments.sort()
    assert _busy(segments, float(wall)) == merge([(a, min(b, float(wall))) for a, b, _ in segments])
