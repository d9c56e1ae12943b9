"""The roofline cost model (shared/FACTS.md, "Cost model"): every time the simulator charges.

Decode is memory-bound (weights plus KV reads per step), prefill and training compute-bound,
collectives and weight transfers a latency plus bytes over the link they cross. Parameters come
from aspc/data/{hardware,models,costmodel}.toml.
"""
from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass
from importlib import resources

from aspc.ir.facts import DTYPE_BYTES, GIB, Hardware, ModelArch, hardware_table
from aspc.ir.memory import generation_need
from aspc.ir.graph import Parallel
from aspc.ir.kinds import kind_rule
from aspc.plan.execution_plan import ExecutionPlan, ModelPlan, StagePlan


@functools.lru_cache(maxsize=1)
def parameters() -> dict:
    return tomllib.loads(resources.files("aspc.data").joinpath("costmodel.toml").read_text())


@dataclass(frozen=True)
class GenerationCost:
    """Decode-step time of one instance as t(B, C) = alpha * C + beta(B), C = sum of contexts."""

    arch: ModelArch
    hw: Hardware
    par: Parallel
    dtype_bytes: int
    graph_mode: bool

    @property
    def _bw(self) -> float:
        return parameters()["efficiency"]["bandwidth"] * self.hw.hbm_tbps * 1e12

    @property
    def _flops(self) -> float:
        return parameters()["efficiency"]["flops"] * self.hw.peak_bf16_tflops * 1e12

    @functools.cached_property
    def alpha(self) -> float:
        """Seconds per token of context per step: KV reads, spread over the instance's devices."""
        kv = self.arch.kv_bytes_per_token(self.dtype_bytes)
        split = self.par.dp * (1 if self.arch.attention == "mla" else min(self.par.tp, self.arch.kv_heads))
        return kv / (self._bw * split * self.par.pp)

    @functools.cached_property
    def _shape(self) -> tuple[float, float, float, float]:
        """(dense bytes read per step, all expert bytes, compute seconds per sequence, launch overhead)."""
        g = parameters()["generation"]
        dense = self.arch.dense_params() / self.par.tp * self.dtype_bytes / (self._bw * self.par.pp)
        experts = self.arch.expert_params() / self.par.ep * self.dtype_bytes / (self._bw * self.par.pp)
        compute = 2 * self.arch.active_params() / (self._flops * self.par.tp * self.par.pp)
        launch = g["launch_graph_s"] if self.graph_mode else g["launch_eager_per_layer_s"] * self.arch.layers
        return dense, experts, compute, launch

    @functools.cached_property
    def _betas(self) -> dict[int, float]:
        return {}

    def beta(self, batch: int) -> float:
        """Seconds per step besides KV reads (memoised per batch size: the simulator asks for the
        same few batch sizes hundreds of thousands of times)."""
        found = self._betas.get(batch)
        if found is None:
            found = self._betas[batch] = self._beta(batch)
        return found

    def _beta(self, batch: int) -> float:
        """Weight reads or compute, launch, TP and expert collectives. MoE reads the experts a
        batch touches: 1 - (1 - k/E)^B of them per layer."""
        dense, experts, compute, launch = self._shape
        touched = 1 - (1 - self.arch.top_k / self.arch.experts) ** max(batch, 1) if self.arch.experts else 0
        per_rank = max(batch / self.par.dp, 1)
        return max(dense + experts * touched, compute * per_rank) + launch + self.communication(max(batch, 1))

    def prefill(self, tokens: int, requests: int = 1, squares: float = 0.0) -> float:
        """`tokens` new tokens, `squares` the sum over requests of (context after)^2 - (context
        before)^2: causal attention over the whole context costs 2·squares·L·H·d FLOPs beside the
        GEMMs' 2·N_active per token (about 30% more at 30k tokens on Qwen2.5-32B). A caller that
        does not know the contexts passes 0 (prompts alone: the prompt lengths squared)."""
        flops_per_token, flops_per_second = self._prefill_rates
        attention = 2 * squares * self.arch.layers * self.arch.heads * self.arch.head_dim
        return (flops_per_token * tokens + attention) / flops_per_second + self.communication(tokens)

    @functools.cached_property
    def _prefill_rates(self) -> tuple[float, float]:
        """(2 x active parameters, the instance's FLOP/s), read once (a prefill per admitted request)."""
        return 2 * self.arch.active_params(), self._flops * (self.par.tp * self.par.pp * self.par.dp)

    @functools.cached_property
    def _communications(self) -> dict[float, float]:
        return {}

    def communication(self, tokens: float) -> float:
        """Collectives of one forward pass of the instance over `tokens` tokens (a decode step's
        batch, a prefill's prompt tokens), per pipeline stage. Assumption: not overlapped with
        compute (no micro-batch overlap in the engine). Memoised per token count."""
        found = self._communications.get(tokens)
        if found is None:
            found = self._communications[tokens] = \
                (self.tp_all_reduce(tokens) + self.expert_all_to_all(tokens)) / self.par.pp
        return found

    def tp_all_reduce(self, tokens: float) -> float:
        """Megatron-style TP: two all-reduces per layer (after attention, after the MLP) of a
        data-parallel rank's activations, tokens/dp x hidden x dtype bytes each."""
        if self.par.tp == 1:
            return 0.0
        nbytes = max(tokens / self.par.dp, 1) * self.arch.hidden * self.dtype_bytes
        return 2 * self.arch.layers * all_reduce_seconds(nbytes, self.par.tp, self.hw)

    def expert_all_to_all(self, tokens: float) -> float:
        """Expert parallelism: a dispatch and a combine all-to-all per MoE layer over the EP group,
        each device sending its tokens' top-k hidden states. Each TP rank dispatches 1/tp of its
        data-parallel rank's tokens (assumption: tokens split over TP ranks before dispatch)."""
        if self.par.ep == 1 or not self.arch.experts:
            return 0.0
        tokens_per_device = max(tokens / (self.par.dp * self.par.tp), 1)
        nbytes = tokens_per_device * self.arch.top_k * self.arch.hidden * self.dtype_bytes
        return 2 * self.arch.moe_layers * all_to_all_seconds(nbytes, self.par.ep, self.hw)

    def capacity(self, tokens_per_sequence: float, memory: float | None = None,
                 max_num_seqs: int | None = None) -> int:
        """Concurrent sequences: the KV room of the `memory` share of each device (the stage's
        gpu_memory_utilization; default [efficiency] memory) after the weight shard, capped by
        `max_num_seqs` per data-parallel rank as vLLM counts it (default [generation])."""
        room = self._kv_room_bytes(memory)
        per_seq = tokens_per_sequence * self.arch.kv_bytes_per_token(self.dtype_bytes) * self.alpha_split()
        by_memory = int(room / per_seq) * self.par.dp if room > 0 else 1
        max_num_seqs = max_num_seqs or parameters()["generation"]["max_num_seqs_per_rank"]
        return max(1, min(by_memory, max_num_seqs * self.par.dp))

    def kv_tokens(self, memory: float | None = None) -> float:
        """Tokens of context the instance's KV cache holds, all sequences together (each data-parallel
        rank its share): the KV room `capacity` divides among sequences of the mean length. The
        simulator never lets an instance hold more (it preempts, as vLLM's scheduler does)."""
        per_token = self.arch.kv_bytes_per_token(self.dtype_bytes) * self.alpha_split()
        return max(self._kv_room_bytes(memory), 0.0) / per_token * self.par.dp

    def _kv_room_bytes(self, memory: float | None) -> float:
        """Bytes of each device left for the KV cache: the `memory` share (default [efficiency]
        memory) less the activation reserve and the weight shard; negative when the shard does not fit."""
        usable_bytes = self.hw.hbm_gib * GIB * (memory or parameters()["efficiency"]["memory"])
        weights = (self.arch.dense_params() / self.par.tp + self.arch.expert_params() / self.par.ep) \
            * self.dtype_bytes / self.par.pp
        return usable_bytes * (1 - parameters()["generation"]["activation_reserve"]) - weights

    def alpha_split(self) -> float:
        split = 1 if self.arch.attention == "mla" else min(self.par.tp, self.arch.kv_heads)
        return 1 / (split * self.par.pp)


@dataclass(frozen=True)
class LearnerCost:
    """Forward (reference, critic) and training time of micro-batches on one data-parallel rank."""

    arch: ModelArch
    hw: Hardware
    par: Parallel
    recompute: bool
    dtype_bytes: int = DTYPE_BYTES["bf16"]

    @property
    def rank_devices(self) -> int:
        return self.par.tp * self.par.pp * self.par.cp

    def _attention(self, squares: float) -> float:
        return squares * self.arch.layers * self.arch.heads * self.arch.head_dim

    def forward(self, tokens: int, squares: float) -> float:
        """At the GEMM efficiency eta_f, which holds no communication: plus the TP all-reduces and
        expert all-to-alls of the pass, as generation's prefill pays them."""
        flops = 2 * self._active_params * tokens + 4 * self._attention(squares)
        return flops / self._forward_rate + self.forward_communication(tokens)

    @functools.cached_property
    def _active_params(self) -> int:  # read once: a work prices hundreds of micro-batches
        return self.arch.active_params()

    @functools.cached_property
    def _forward_rate(self) -> float:
        return parameters()["efficiency"]["flops"] * self.hw.peak_bf16_tflops * 1e12 * self.rank_devices

    @functools.cached_property
    def _train_rate(self) -> float:
        mfu = parameters()["efficiency"]["train_mfu_moe" if self.arch.experts else "train_mfu_dense"]
        return mfu * self.hw.peak_bf16_tflops * 1e12 * self.rank_devices

    @functools.cached_property
    def _forward_communications(self) -> dict[int, float]:
        return {}

    def forward_communication(self, tokens: int) -> float:
        """A rank's tokens split over its context-parallel ranks; per pipeline stage (memoised)."""
        found = self._forward_communications.get(tokens)
        if found is None:
            found = self._forward_communications[tokens] = self._forward_communication(tokens)
        return found

    def _forward_communication(self, tokens: int) -> float:
        per_cp = max(tokens / self.par.cp, 1)
        tp = 2 * self.arch.layers * all_reduce_seconds(per_cp * self.arch.hidden * self.dtype_bytes,
                                                       self.par.tp, self.hw)
        dispatched = max(per_cp / self.par.tp, 1) * self.arch.top_k * self.arch.hidden * self.dtype_bytes
        ep = 2 * self.arch.moe_layers * all_to_all_seconds(dispatched, self.par.ep, self.hw)  # 0 when dense
        return (tp + ep) / self.par.pp

    def train(self, tokens: int, squares: float) -> float:
        """At the published training MFU, which already holds training's TP/CP/EP collectives (the
        MFU tables measure whole steps): they are not priced again. Pipeline fill/drain is not in
        it: learner.work_cost adds it."""
        flops = (8 if self.recompute else 6) * self._active_params * tokens + 12 * self._attention(squares)
        return flops / self._train_rate

    def optimizer(self, shared_gbps: float = 0.0) -> float:
        """One AdamW update (read and write 16 bytes of state per local parameter) after the step's
        gradient reduction; `shared_gbps`: what a weight broadcast takes of the network meanwhile."""
        local = self.arch.total_params() / (self.par.tp * self.par.pp * self.par.dp * self.par.cp)
        bw = parameters()["efficiency"]["bandwidth"] * self.hw.hbm_tbps * 1e12
        return 2 * 16 * local / bw + self.gradient_reduction(shared_gbps)

    def gradient_reduction(self, shared_gbps: float = 0.0) -> float:
        """The step's data-parallel gradient reduction, once before the optimizer step
        (backends/ascend/megatron_model.gradient_reduction): DDP's buffer of this rank's gradients
        (its tp x pp share, experts over ep too, in the parameters' dtype) reduced over the dp x cp
        ranks -- reduce-scatter and, under the distributed optimizer, the parameters' all-gather: an
        all-reduce's bytes. Megatron's rank order puts tp and cp inside dp, so the group spans
        tp x cp x dp devices: the scale-up link when they fit a node, else the network, of which a
        weight broadcast leaving the trainer meanwhile takes `shared_gbps` (a ring runs at its
        slowest member's rate: the sending rank's)."""
        group = self.par.dp * self.par.cp
        if group == 1:
            return 0.0
        arch = self.arch
        local = (arch.total_params() - arch.expert_params()) / (self.par.tp * self.par.pp) + \
            arch.expert_params() / (self.par.tp * self.par.pp * self.par.ep)
        moved = 2 * (group - 1) / group * local * self.dtype_bytes
        return _collective(moved, group, self.hw, span=self.par.tp * group, shared_gbps=shared_gbps)


# ---- collectives: a latency plus the bytes one device moves over its group's link ----
def _collective(nbytes_moved: float, group: int, hw: Hardware, span: int | None = None,
                shared_gbps: float = 0.0) -> float:
    """`span`: the consecutive devices the group's ranks lie across (default: the group; a strided
    group spans more, and crosses the network once that is more than a node); `shared_gbps`: what
    other traffic takes of the network meanwhile (a ring runs at its slowest member's rate)."""
    c = parameters()["communication"]
    if hw.group_fits_a_node(span or group):
        return c["link_latency_s"] + nbytes_moved / (c["bandwidth_efficiency"] * hw.group_gbps(group) * 1e9)
    rate = max(c["bandwidth_efficiency"] * hw.network_gbps - shared_gbps, 1e-3)
    return c["network_latency_s"] + nbytes_moved / (rate * 1e9)


def all_reduce_seconds(nbytes: float, group: int, hw: Hardware) -> float:
    """Ring all-reduce of an `nbytes` buffer: each device moves 2(n-1)/n of it."""
    return _collective(2 * (group - 1) / group * nbytes, group, hw) if group > 1 else 0.0


def all_gather_seconds(nbytes: float, group: int, hw: Hardware) -> float:
    """All-gather of `nbytes` in all: each device receives the (n-1)/n it lacks."""
    return _collective((group - 1) / group * nbytes, group, hw) if group > 1 else 0.0


def all_to_all_seconds(nbytes_per_device: float, group: int, hw: Hardware) -> float:
    """Each device sends what it holds, keeping the 1/n that is its own."""
    return _collective((group - 1) / group * nbytes_per_device, group, hw) if group > 1 else 0.0


# ---- weight sync (docs/simulator.md, "The cost model"; costmodel.toml [transfer]) ----
def weight_shard_bytes(arch: ModelArch, par: Parallel, nbytes_per_param: int) -> float:
    """Weight bytes on one device of a layout: dense weights split by TP, experts by EP, both by PP."""
    return (arch.dense_params() / par.tp + arch.expert_params() / par.ep) * nbytes_per_param / par.pp


def broadcast_seconds(nbytes: float, receivers: int, network_gbps: float) -> float:
    """One trainer rank broadcasts full tensors in buckets to `receivers` ranks over the network
    (vllm-ascend vllm_ascend/distributed/weight_transfer/hccl_engine.py, packed_tensor.py): a
    pipelined tree moves bytes / bandwidth whatever the receiver count, plus a hop latency per
    tree level per bucket. The bandwidth is the network's share, capped by the measured rate."""
    t, c = parameters()["transfer"], parameters()["communication"]
    hops = math.ceil(math.log2(max(receivers, 1) + 1))
    buckets = math.ceil(nbytes / t["broadcast_bucket_bytes"])
    return nbytes / (broadcast_gbps(network_gbps) * 1e9) + buckets * hops * c["network_latency_s"]


def broadcast_gbps(network_gbps: float) -> float:
    """The rate of the trainer's weight broadcast: the network's achieved share, capped by the
    measured weight-sync rate."""
    return min(parameters()["transfer"]["weight_sync_gbps"],
               parameters()["communication"]["bandwidth_efficiency"] * network_gbps)


def gather_to_sender_seconds(arch: ModelArch, train: Parallel, hw: Hardware, nbytes_per_param: int) -> float:
    """The trainer assembles full tensors before its sending rank broadcasts them: each pipeline
    stage's tensors broadcast to the others, then all-gathered over TP (dense) and EP (experts)
    (verl verl/utils/megatron_utils.py, per_tensor_generator)."""
    dense, experts = arch.dense_params() * nbytes_per_param, arch.expert_params() * nbytes_per_param
    stages = _stage_broadcast_seconds(weight_shard_bytes(arch, train, nbytes_per_param) * train.pp, train, hw)
    return stages + all_gather_seconds(dense, train.tp, hw) + all_gather_seconds(experts, train.ep, hw)


def reshard_seconds(arch: ModelArch, train: Parallel, gen: Parallel, hw: Hardware, nbytes_per_param: int) -> float:
    """Colocated resharding in place (MindSpeed-RL mindspeed_rl/workers/resharding/
    vllm_weight_container.py; verl gathers the same way in megatron_utils.per_tensor_generator):
    each stage's dense weights all-gathered within the training TP group and re-split locally for
    the generation TP, every stage's generation shard broadcast to the other stages (generation
    runs without PP), and the experts moved from the training to the generation EP layout."""
    dense = arch.dense_params() * nbytes_per_param
    gather = all_gather_seconds(dense / train.pp, train.tp, hw)
    stages = _stage_broadcast_seconds(weight_shard_bytes(arch, gen, nbytes_per_param), train, hw)
    return gather + stages + _expert_moves_seconds(arch, train, gen, hw, nbytes_per_param)


def _stage_broadcast_seconds(shard_bytes: float, train: Parallel, hw: Hardware) -> float:
    """Each device receives the (pp-1)/pp of a `shard_bytes` shard that other pipeline stages hold,
    over the link the training layout spans (pipeline peers are tp x cp x dp ranks apart)."""
    if train.pp == 1:
        return 0.0
    return _collective(shard_bytes * (train.pp - 1) / train.pp, train.devices, hw)


def _expert_moves_seconds(arch: ModelArch, train: Parallel, gen: Parallel, hw: Hardware,
                          nbytes_per_param: int) -> float:
    """Experts change hands point to point when the EP degree changes; each device receives its
    generation expert shard of one stage (assumption: none of it is already local)."""
    if train.ep == gen.ep or not arch.experts:
        return 0.0
    shard = arch.expert_params() * nbytes_per_param / (gen.ep * train.pp)
    return all_to_all_seconds(shard, max(train.ep, gen.ep), hw)


def colocated_load_seconds(plan: ExecutionPlan, train: StagePlan, gen: StagePlan) -> float:
    """A generation instance on the trainer's devices (a time-shared pool): resharding in place,
    then its engine's own weight shard onloads from host (vLLM sleep / wake_up)."""
    arch, nbytes = _weights_of(plan, gen)
    resharding = reshard_seconds(arch, train.parallel, gen.parallel, hardware_of(plan, gen), nbytes)
    return resharding + offload_seconds(weight_shard_bytes(arch, gen.parallel, nbytes))


def broadcast_load_seconds(plan: ExecutionPlan, train: StagePlan, gen: StagePlan) -> float:
    """A generation instance on its own devices takes part in the trainer's broadcast of the full
    weights to every generation rank, then reloads its engine (the fixed cost)."""
    arch, nbytes = _weights_of(plan, gen)
    receivers = sum(i.device_count for i in gen.instances)
    network = min(hardware_of(plan, train).network_gbps, hardware_of(plan, gen).network_gbps)
    fixed = parameters()["transfer"]["weight_sync_fixed_s"]
    return fixed + broadcast_seconds(arch.total_params() * nbytes, receivers, network)


def publish_seconds(plan: ExecutionPlan, train: StagePlan) -> float:
    """The trainer's side of a disaggregated sync: assembling full tensors on its sending rank."""
    arch, nbytes = _weights_of(plan, train)
    return gather_to_sender_seconds(arch, train.parallel, hardware_of(plan, train), nbytes)


def _weights_of(plan: ExecutionPlan, stage: StagePlan) -> tuple[ModelArch, int]:
    model = plan.model(stage.model)
    return model.arch, DTYPE_BYTES[model.dtype]


def offload_seconds(nbytes_per_device: float) -> float:
    """Host <-> device copy of one device's bytes; every device copies its own at the same time."""
    return nbytes_per_device / (parameters()["transfer"]["offload_gbps"] * 1e9)


def hardware_of(plan: ExecutionPlan, stage: StagePlan) -> Hardware:
    return hardware_table()[plan.pool(stage.pool).hardware]


def memory_share(memory: float, sharers: int) -> float:
    """An engine's gpu_memory_utilization when `sharers` processes start on its NPUs: its equal share,
    rounded down, so that vllm-ascend's start-up free-memory check passes whoever starts first (the
    Ascend launch gives it this; the simulator prices it)."""
    return memory if sharers == 1 else math.floor(memory / sharers * 100) / 100


def engine_sharers(plan: ExecutionPlan, stage: StagePlan) -> int:
    """Processes on one NPU of a generate stage's pool at launch: the engine's, and where it
    time-shares the pool, one per other device stage there that runs processes of its own (a stage
    that runs inside the trainer's processes adds none; aspc/backends/ascend/lowering.py)."""
    if stage.placement != "time_shared":
        return 1
    trains = bool(plan.stages_of("train"))
    others = [s for s in plan.stages if s.pool == stage.pool and s.name != stage.name
              and (rule := kind_rule(s.kind, _source_funcs(s))).ascend is not None
              and not (rule.ascend.in_trainer and trains)]
    return 1 + len(others)


def _source_funcs(stage: StagePlan):
    return [s.func for s in dict(stage.options).get("sources", ())] if stage.kind == "reward" else []


def engine_memory(plan: ExecutionPlan, stage: StagePlan, sharers: int | None = None) -> float:
    """The share of each device a generate stage's engine takes, the one the Ascend launch gives it
    (aspc/backends/ascend/engine_args.py) and the simulator prices: its gpu_memory_utilization
    (default [efficiency] memory, vLLM's 0.9) divided among the `sharers` processes that start on its
    NPUs (default: `engine_sharers`), or what it needs to start when that is more (weights, one
    max_model_len of KV, the runtime margin)."""
    memory = dict(stage.options).get("gpu_memory_utilization") or parameters()["efficiency"]["memory"]
    sharers = engine_sharers(plan, stage) if sharers is None else sharers
    return engine_share(plan, stage, plan.model(stage.model), engine_model_len(plan, stage),
                        memory_share(memory, sharers))


def engine_model_len(plan: ExecutionPlan, stage: StagePlan) -> int:
    """vLLM's max_model_len of a generate stage's engine: the longest prompt and its max_tokens, or
    an agentic episode's whole context (`episode_model_len`)."""
    max_model_len = plan.dataset(stage.data).max_prompt + dict(stage.options)["max_tokens"]
    environments = plan.stages_of("environment")
    if environments:
        return episode_model_len(plan.model(stage.model), dict(environments[0].options), max_model_len)
    return max_model_len


# vllm-ascend's non-KV memory beyond the weights: the profile run's activation peak, ACL graphs, HCCL
# buffers, the CANN context (an estimate read from worker.py's accounting, never measured on an NPU)
ENGINE_RUNTIME_BYTES = 4 * GIB


def engine_need(model: ModelPlan, stage: StagePlan, max_model_len: int) -> float:
    """Bytes one engine process needs on each of its NPUs to start: its weight shard, a KV cache for
    one request of max_model_len (vLLM refuses less) and the runtime margin."""
    return generation_need(model.arch, model.dtype, stage.parallel, max_model_len).total + ENGINE_RUNTIME_BYTES


def engine_share(plan: ExecutionPlan, stage: StagePlan, model: ModelPlan, max_model_len: int, share: float) -> float:
    """gpu_memory_utilization: the equal share among the processes on the engine's NPUs when that
    holds what the engine needs, else the need itself rounded up to a hundredth (the engine then
    starts alone on its NPUs and sleeps before the others start: StageLaunch.startup)."""
    device = hardware_table()[plan.pool(stage.pool).hardware].hbm_gib * GIB
    return max(share, math.ceil(engine_need(model, stage, max_model_len) / device * 100) / 100)


def episode_model_len(model: ModelPlan, environment: dict, single_turn: int) -> int:
    """An agentic episode's context: the prompt, its model tokens and an observation after every turn
    but the last (each at most max_tool_tokens), within the model's context (vLLM refuses more than
    its max_position_embeddings). The CPU generator's episodes end where this runs out."""
    observations = (environment["max_turns"] - 1) * environment["max_tool_tokens"]
    return min(model.arch.max_seq, single_turn + observations)


def usable_hbm(hw: Hardware) -> float:
    return hw.hbm_gib * GIB * parameters()["efficiency"]["memory"]


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
