"""The collector pause of the front end and the simulator (aspc/memory.py)."""
import gc

from aspc.memory import no_cycle_collection


class Record:
    pass


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with no_cycle_collection():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_what_survives_the_block_is_in_the_oldest_generation_unscanned():
    with no_cycle_collection():
        kept = [Record() for _ in range(1000)]
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(r) in oldest for r in kept)  # the next young collection does not scan them


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with no_cycle_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
