"""How many sequences a CPU generation instance holds at once (no torch: the simulator uses it)."""

MAX_SLOTS = 64


def default_slots(samples_per_step: int, instances: int, group: int) -> int:
    """KV slots per instance: a share of the step, at least one group, at most MAX_SLOTS."""
    return max(group, min(MAX_SLOTS, -(-samples_per_step // instances)))
