"""A generation instance with dp > 1: its dp vLLM engines (one per data-parallel rank, each with the
launch plan's environment for its rank: its NPUs and, for a MoE model, VLLM_DP_*), which the
controller sees as the one instance. What this group does is the engine group's own mechanics, as
vLLM's data-parallel front end does them, not scheduling:
- a request goes to the rank vLLM's load balancer would pick (`least_loaded_rank`);
- every rank with requests in flight is polled for its finished samples at each step;
- a MoE group's ranks step together (`lockstep`): vLLM 0.23.0's DPEngineCoreProc
  (vllm/v1/engine/core.py, run_busy_loop) runs a dummy batch on a rank whose requests are done while
  any peer still has some (an all-reduce every 32 steps, `_has_global_unfinished_reqs`, ends the
  "wave" on every rank at once), because each forward pass's expert-parallel collectives need every
  rank. Offline (no DP coordinator: `has_coordinator` False) an idle rank's engine starts a wave only
  on a request of its own (`add_request`), so a wave that starts on some ranks only hangs the others'
  collectives. vLLM's example examples/offline_inference/data_parallel.py gives such a rank "a
  placeholder prompt"; here every rank that gets no request of a batch gets a one-token placeholder
  (`PLACEHOLDER`, its output dropped), so the ranks always start a wave together. This relies on each
  engine core being a process of its own (run_executors.COLOCATED_ENV): in-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0) every rank's front end would have to call
  has_unfinished_requests in lockstep (vllm/v1/engine/llm_engine.py, has_unfinished_requests_dp);
- sleep, wake and the weight refresh reach every rank: the refresh's calls run on each rank in the
  launch plan's order and each streamed chunk is loaded by every rank before the trainer ranks refill
  their buffers (each engine worker maps the handle of the trainer rank on its own NPU; with expert
  parallelism vLLM's FusedMoE.weight_loader keeps the experts its rank owns and skips the rest:
  vllm/model_executor/layers/fused_moe/layer.py, expert id -1).
The ranks are reached through `ranks.call(method, {rank: args})`: in this process (`LocalRanks`,
the local runtime) or as Ray actors on their NPUs' nodes (aspc/drivers/ray/colocated.py)."""
from __future__ import annotations

from typing import Any

PLACEHOLDER = ("dp-placeholder",)  # the key of a rank's placeholder request (never the controller's)


def least_loaded_rank(loads: list[tuple[int, int]]) -> int:
    """The rank vLLM's data-parallel load balancer sends a request to: the lowest `waiting * 4 +
    running` of (waiting, running) per rank, the first in rank order on a tie
    (vllm/v1/engine/core_client.py, DPLBAsyncMPClient.get_core_engine_for_request; one client, so
    its scan starts at rank 0)."""
    scores = [waiting * 4 + running for waiting, running in loads]
    return scores.index(min(scores))


def rank_loads(in_flight: list[int], slots: int) -> list[tuple[int, int]]:
    """(waiting, running) per rank from its requests in flight: the scheduler runs up to
    max_num_seqs (`slots`) of them and queues the rest."""
    return [(max(0, n - slots), min(n, slots)) for n in in_flight]


class LocalRanks:
    """The ranks' engines in this process, called one after the other."""

    def __init__(self, engines: list):
        self.engines = engines

    def call(self, method: str, args: dict[int, tuple]) -> dict[int, Any]:
        return {rank: getattr(self.engines[rank], method)(*a) for rank, a in args.items()}


class EngineGroup:
    """One instance's dp engine ranks behind the GenerationEngine role (add, step, busy,
    load_weights, sleep, connect). `engines`: its ranks' VllmEngines, not started; `lockstep`: a MoE
    group (VLLM_DP_* set), whose ranks must start each wave together; `addresses`: each rank's node
    (where the Ray runtime starts its actor)."""

    def __init__(self, engines: list, instance: int, lockstep: bool, addresses: list[str] | None = None):
        self.engines, self.instance, self.lockstep = engines, instance, lockstep
        self.addresses = addresses or []
        self.ranks = LocalRanks(engines)
        self.slots = engines[0].slots
        self.in_flight = [0] * len(engines)  # requests per rank, placeholders included
        self.placeholders = [0] * len(engines)
        self.pending: list[tuple] = []
        self.version = 0

    @property
    def size(self) -> int:
        return len(self.engines)

    @property
    def busy(self) -> bool:
        return bool(self.pending) or any(self.in_flight)

    def add(self, key: Any, ids: list[int], seed: int) -> None:
        self.pending.append((key, list(ids), seed))

    def step(self) -> list:
        """Spread the requests that came in since the last step over the ranks, then poll every
        rank with requests in flight; placeholders' outputs are dropped."""
        batch, self.pending = self.pending, []
        requests = self.spread(batch)
        polled = {rank: (requests.get(rank, []),) for rank in range(self.size) if requests.get(rank) or
                  self.in_flight[rank]}
        finished = []
        for rank, done in sorted(self.ranks.call("serve", polled).items()):
            self.in_flight[rank] -= len(done)
            real = [f for f in done if f.key != PLACEHOLDER]
            self.placeholders[rank] -= len(done) - len(real)
            finished += real
        return finished

    def spread(self, batch: list[tuple]) -> dict[int, list[tuple]]:
        """Each request of `batch` on the rank vLLM's balancer picks, (key, ids, seed, max_tokens);
        in a lockstep group, a one-token placeholder on each rank that gets none of them."""
        requests: dict[int, list[tuple]] = {}
        for key, ids, seed in batch:
            rank = least_loaded_rank(rank_loads(self.in_flight, self.slots))
            requests.setdefault(rank, []).append((key, ids, seed, None))
            self.in_flight[rank] += 1
        if self.lockstep and batch:
            for rank in range(self.size):
                if rank not in requests:
                    requests[rank] = [(PLACEHOLDER, batch[0][1][:1], 0, 1)]
                    self.in_flight[rank] += 1
                    self.placeholders[rank] += 1
        return requests

    def load_weights(self, published) -> None:
        """Every rank takes version `published.version` by the launch plan's refresh calls, one call
        on all ranks before the next; each chunk the trainer ranks send is loaded by every rank
        before the next is asked for (which lets them refill their buffers)."""
        from aspc.backends.ascend.engine_actor import VllmEngine, refresh_call_name

        everyone = dict.fromkeys(range(self.size), ())
        self.ranks.call("check_connected", everyone)
        pending = published.sender.start(published.version, self.instance)
        try:
            for step in self.engines[0].refresh["calls"]:
                if refresh_call_name(step) != "update_weights":
                    self.ranks.call("refresh_step", dict.fromkeys(range(self.size), (step,)))
                    continue
                for info in VllmEngine.update_infos(published, pending):
                    self.ranks.call("load_chunk", dict.fromkeys(range(self.size), (info,)))
        finally:
            published.sender.wait(pending)
        self.ranks.call("refreshed", dict.fromkeys(range(self.size), (published.version,)))
        self.version = published.version

    def connect(self, init_info: dict) -> None:
        self.ranks.call("connect", dict.fromkeys(range(self.size), (init_info,)))

    def sleep(self) -> None:
        """Every rank sleeps, once its placeholders are done (they end after one token; the
        controller switches only when its own requests are)."""
        while any(self.placeholders) and self.in_flight == self.placeholders:
            self.step()
        self.ranks.call("sleep", dict.fromkeys(range(self.size), ()))
