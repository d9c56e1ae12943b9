"""How many sequences a CPU generation instance holds at once (no torch: the simulator uses it)."""

MAX_SLOTS = 64


def default_slots(samples_per_step: int, instances: int, group: int, max_num_seqs: int | None = None,
                  dp: int = 1) -> int:
    """KV slots per instance: a share of the step, at least one group, at most MAX_SLOTS; a stage's
    max_num_seqs caps that further, per data-parallel rank as vLLM counts it (times dp)."""
    slots = max(group, min(MAX_SLOTS, -(-samples_per_step // instances)))
    return slots if max_num_seqs is None else min(slots, max_num_seqs * dp)
