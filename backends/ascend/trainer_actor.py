"""The policy's learner on NPUs: a megatron-core GPTModel per rank (through the MindSpeed adaptor),
trained on the plan's packed micro-batches, and forward-only reference models compiled with
torchair where the launch plan says so. Every platform import is inside the function that needs
it; `pack` is pure and tested on CPU, `build_gpt` builds on CPU (gloo, one rank).

Followed: megatron-core 0.16.1 (`get_gpt_layer_local_spec`, `get_gpt_decoder_block_spec`,
`GPTModel(pre_process, post_process)`, `get_forward_backward_func`, `vocab_parallel_cross_entropy`,
`get_megatron_optimizer`), MindSpeed-RL's actor worker (mindspeed_rl/workers/actor_hybrid_worker.py:
the MindSpeed adaptor imported first, rewards and advantages on the host, one optimizer step per
policy version) and verl's megatron actor (packed rows with per-sequence positions)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from aspc.backends.ascend.reshard import Layout, grouped_to_sequential
from aspc.backends.ascend.weight_sync import gather_hf, whole_hf_in_place
from aspc.backends.cpu.losses import group_advantages, policy_loss

DTYPE_FIELDS = ("params_dtype", "pipeline_dtype")


def materialize(config: dict) -> dict:
    """The launch plan's JSON config with dtype names turned into torch dtypes."""
    return {k: getattr(torch, v) if k in DTYPE_FIELDS else v for k, v in config.items()}


def import_mindspeed(argv: list[str]) -> None:
    """MindSpeed's adaptor patches megatron for NPUs and parses sys.argv when imported; its features
    (context parallelism among them) switch on from the flags the launch plan gives
    (`builders.mindspeed_argv`, backends/ascend/megatron_args.py)."""
    import sys

    saved, sys.argv = sys.argv, ["aspc", *argv]
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    finally:
        sys.argv = saved


def build_gpt(stage: dict, rank_args: dict, use_cpu_initialization: bool = False):
    """This rank's GPTModel (model-parallel state already initialised) as the launch plan says:
    `builders.config_class` (MLATransformerConfig for MLA), `builders.layer_spec` (the block spec
    for MoE and MLA models, the local spec with RMSNorm and q/k norm otherwise), the stage's
    model_args and this rank's `rank_args` (pre_process / post_process of its pipeline stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_config

    builders = stage["builders"]
    config_cls = getattr(transformer_config, builders["config_class"])
    config = config_cls(**materialize(stage["config"]), activation_func=torch.nn.functional.silu,
                        use_cpu_initialization=use_cpu_initialization)
    spec = builders["layer_spec"]
    if spec["function"] == "get_gpt_decoder_block_spec":
        # this rank's pipeline stage from megatron's parallel state (0.12.1, MindSpeed's megatron, takes no pp_rank)
        layers = gpt_layer_specs.get_gpt_decoder_block_spec(config, **spec["arguments"])
    else:
        layers = gpt_layer_specs.get_gpt_layer_local_spec(**spec["arguments"])
    return GPTModel(config, transformer_layer_spec=layers, **stage["model_args"], **rank_args)


def initialize_parallel(config: dict, backend: str = "hccl") -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(backend=backend)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launch plan
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config["tensor_model_parallel_size"],
        pipeline_model_parallel_size=config["pipeline_model_parallel_size"],
        context_parallel_size=config["context_parallel_size"],
        expert_model_parallel_size=config["expert_model_parallel_size"])


# ---- packed micro-batches (pure) ----
@dataclass
class MicroBatch:
    """Sequences packed into one row of `tokens` (padded to it: one static shape per bucket for
    graph mode); positions restart per sequence and the causal mask is block-diagonal, so packed
    sequences never attend to each other. Per-token tensors are aligned with `labels`."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention_mask: torch.Tensor  # [1, 1, T, T], True where attention is masked (megatron's convention)
    labels: torch.Tensor  # [1, T]: the next token
    loss_mask: torch.Tensor  # [1, T]: 1 where the label is a response token the model wrote (not a tool's)
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    keys: list
    spans: list  # each sequence's (first, end) label positions of its response tokens
    ref_logprobs: torch.Tensor | None = None  # the reference's, where the rollouts have them (the KL term)


def pack(rollouts: list, tokens: int, advantages: dict | None = None) -> list[MicroBatch]:
    """First-fit-decreasing into rows of at most `tokens` (the pack pass's token budget);
    `advantages`: sample key -> its advantage (0 for a forward-only pass)."""
    rows: list[list] = []
    for r in sorted(rollouts, key=lambda r: -(len(r.prompt) + len(r.response))):
        length = len(r.prompt) + len(r.response)
        if length > tokens:
            raise ValueError(f"a sample of {length} tokens exceeds the micro-batch budget of {tokens}")
        row = next((row for row in rows if sum(len(x.prompt) + len(x.response) for x in row) + length <= tokens), None)
        if row is None:
            rows.append([r])
        else:
            row.append(r)
    return [_micro_batch(row, tokens, advantages or {}) for row in rows]


def _micro_batch(row: list, tokens: int, advantages: dict) -> MicroBatch:
    ids, pos, labels, mask, old, adv, ref = ([0] * tokens for _ in range(7))
    allowed = torch.zeros(tokens, tokens, dtype=torch.bool)
    at, spans = 0, []
    for r in row:
        seq, n_prompt = list(r.prompt) + list(r.response), len(r.prompt)
        end = at + len(seq)
        ids[at:end], pos[at:end] = seq, range(len(seq))
        labels[at:end - 1] = seq[1:]
        counted = getattr(r, "loss_mask", None) or [1] * len(r.response)  # agentic: tool tokens 0
        for i in range(n_prompt - 1, len(seq) - 1):  # position i predicts response token i + 1
            mask[at + i], old[at + i] = counted[i - n_prompt + 1], r.behaviour_logprobs[i - n_prompt + 1]
            ref[at + i] = r.ref_logprobs[i - n_prompt + 1] if r.ref_logprobs is not None else 0.0
            given = advantages.get(r.key, 0.0)  # a sample's advantage, or its tokens' (GAE)
            adv[at + i] = given[i - n_prompt + 1] if isinstance(given, list) else given
        spans.append((at + n_prompt - 1, end - 1))
        allowed[at:end, at:end] = torch.tril(torch.ones(len(seq), len(seq), dtype=torch.bool))
        at = end
    as_row = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype)[None]  # noqa: E731
    return MicroBatch(as_row(ids), as_row(pos), (~allowed)[None, None], as_row(labels), as_row(mask, torch.float),
                      as_row(old, torch.float), as_row(adv, torch.float), [r.key for r in row], spans,
                      as_row(ref, torch.float) if all(r.ref_logprobs is not None for r in row) else None)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(label) per position from vocabulary-parallel logits [B, T, V/tp] (megatron's
    vocab_parallel_cross_entropy is the negative log-likelihood, over [T, B])."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = (logits / temperature).transpose(0, 1).contiguous().float()
    return -vocab_parallel_cross_entropy(scaled, labels.t().contiguous()).t()


# ---- the learner ----
def layout_of(stage: dict, world_size: int):
    """The model's shape, the job's parallel layout and the trainer's reshard.Layout (pipeline split,
    router expert bias), read back from a launch stage's megatron config (what every rank has), for
    the weight sync."""
    from aspc.ir.graph import Parallel

    c = stage["config"]
    tp, pp, cp = c["tensor_model_parallel_size"], c["pipeline_model_parallel_size"], c["context_parallel_size"]
    parallel = Parallel(tp=tp, pp=pp, cp=cp, dp=world_size // (tp * pp * cp), ep=c["expert_model_parallel_size"])
    return arch_of(stage), parallel, Layout.from_config(c)


def arch_of(stage: dict):
    """The ModelArch that a launch stage's megatron config (TransformerConfig / MLATransformerConfig
    fields, megatron_args.py) and GPTModel arguments describe."""
    from aspc.ir.facts import ModelArch

    c, m = stage["config"], stage["model_args"]
    mla = bool(c.get("multi_latent_attention"))
    rope = c.get("qk_pos_emb_head_dim", 0) if mla else 0
    expert_ffn = c.get("moe_ffn_hidden_size") or 0
    return ModelArch(
        layers=c["num_layers"], hidden=c["hidden_size"], heads=c["num_attention_heads"], kv_heads=c["num_query_groups"],
        head_dim=c["qk_head_dim"] + rope if mla else c.get("kv_channels", 0), ffn=c["ffn_hidden_size"],
        vocab=m["vocab_size"], experts=c.get("num_moe_experts") or 0, top_k=c.get("moe_router_topk", 0),
        expert_ffn=expert_ffn, shared_experts=(c.get("moe_shared_expert_intermediate_size") or 0) // (expert_ffn or 1),
        dense_layers=list(c.get("moe_layer_freq", [1])).count(0),
        tied=m.get("share_embeddings_and_output_weights", False), qkv_bias=c.get("add_qkv_bias", False),
        attention="mla" if mla else "gqa", qk_norm=c.get("qk_layernorm", False) and not mla,
        q_lora_rank=(c.get("q_lora_rank") or 0) if mla else 0, kv_lora_rank=c.get("kv_lora_rank", 0) if mla else 0,
        qk_rope_dim=rope, v_head_dim=c.get("v_head_dim", 0) if mla else 0)


@dataclass(frozen=True)
class SyncSetup:
    arch: object  # aspc.ir.facts.ModelArch of the policy
    parallel: object  # the train stage's aspc.ir.graph.Parallel
    comm: object  # weight_sync.TorchCommunicator over the stage's process groups
    sender: object = None  # weight_sync.WeightSender on rank 0 (separate pools); an IpcSender on every rank (colocated)
    colocated: bool = False  # the engines share the trainer's NPUs: every rank publishes the whole model (npu_ipc)
    layout: object = None  # the trainer's reshard.Layout (layout_of); None refuses MLA models


class Offloadable:
    """A megatron model (`model`, its DDP wrapper) and its `optimizer` that leave the NPU while a
    time-shared pool generates (`offloaded`: what brings them back)."""

    offloaded: list

    def offload(self) -> None:
        """A time-shared pool goes to generation: parameters, gradients and optimizer state to host
        memory (verl's offload_megatron_model_to_cpu / offload_megatron_optimizer); once."""
        if self.offloaded:
            return
        self.offloaded = offload_model(self.model) + offload_optimizer(self.optimizer, self.model)
        empty_device_cache()

    def onload(self) -> None:
        """The pool comes back to the trainer: everything `offload` moved goes back where it was."""
        for restore in self.offloaded:
            restore()
        self.offloaded = []


class MegatronTrainer(Offloadable):
    """The Trainer role (aspc/roles.py) on one megatron rank; every rank of the job runs the same
    calls in the same order (the driver's learner actor is rank 0, the others follow its calls).
    `reward_fn` scores on the host (rule and python rewards); `loss` is aspc's policy loss
    (backends/cpu/losses.py: the same surrogate the CPU backend trains with)."""

    def __init__(self, stage: dict, rank_args: dict, settings, reward_fn, sync, reference=None):
        """`sync`: how weights leave (a SyncSetup: the model's shape, the stage's parallel layout, the
        communicator, and on rank 0 the WeightSender)."""
        self.stage, self.settings, self.reward_fn = stage, settings, reward_fn
        self.sync, self.reference_model = sync, reference
        self.model = self._wrapped(load_checkpoint(build_gpt(stage, rank_args), stage))
        self.optimizer = self._optimizer()
        self.version = 0
        self.stats: list[dict] = []
        self.offloaded: list = []  # the restore steps of what `offload` moved to host memory

    @staticmethod
    def _wrapped(model):
        """megatron's optimizer takes DDP-wrapped chunks; gradients are reduced by finalize_model_grads."""
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        model.config.finalize_model_grads_func = finalize_model_grads
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(), module=model)

    def _optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        s = self.settings
        optimizer_config = OptimizerConfig(optimizer="adam", lr=s.lr, weight_decay=s.weight_decay,
                                           clip_grad=s.grad_clip, bf16=self.stage["config"].get("bf16", False),
                                           params_dtype=materialize(self.stage["config"])["params_dtype"])
        return get_megatron_optimizer(optimizer_config, [self.model])

    def reward(self, rollouts: list) -> None:
        for r in rollouts:
            r.reward = r.task_reward = self.reward_fn(r)

    def reference(self, rollouts: list) -> None:
        found = self._logprobs(self.reference_model or self.model, rollouts)
        for r in rollouts:
            r.ref_logprobs = found[r.key]

    def values(self, rollouts: list) -> None:
        raise NotImplementedError("a megatron critic (value head) is not built yet; train with grpo or dapo")

    def train(self, rollouts: list) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = pack(rollouts, self.stage["micro_batching"]["tokens"], self._advantages(rollouts))
        step = get_forward_backward_func()
        self.stats += step(forward_step_func=self._forward_step, data_iterator=iter(batches), model=[self.model],
                           num_microbatches=len(batches), seq_length=self.stage["micro_batching"]["tokens"],
                           micro_batch_size=1, forward_only=False) or []

    def _advantages(self, rollouts: list) -> dict:
        """Sample key -> its advantage (the controller hands whole groups), or with GAE (PPO) its
        response tokens' advantages from the values the critic gave (critic.py)."""
        s = self.settings
        if s.estimator == "gae":
            from aspc.backends.ascend.critic import gae_targets

            return gae_targets(rollouts, s)[0]
        rewards = group_advantages([r.reward for r in rollouts], s.group, s.estimator, s.normalize,
                                   [r.masked for r in rollouts])
        return dict(zip((r.key for r in rollouts), rewards))

    def _forward_step(self, data_iterator, model):

        mb = next(data_iterator)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        s = self.settings

        def loss_func(output):
            logp = token_logprobs(output, mb.labels, s.temperature)
            kl = s.kl if mb.ref_logprobs is not None else 0.0  # the k3 penalty against the reference
            loss, stats = policy_loss(logp, mb.old_logprobs, mb.ref_logprobs, mb.advantages, mb.loss_mask, s.loss,
                                      s.clip, s.clip_high, kl, s.loss_agg)
            return loss, {"loss": loss.detach(), **stats}

        return logits, loss_func

    def optimizer_step(self) -> dict:
        succeeded, grad_norm, _ = self.optimizer.step()
        self.optimizer.zero_grad()
        stats, self.stats = self.stats, []
        return {"grad_norm": float(grad_norm or 0.0), "update_skipped": not succeeded, "micro_batches": len(stats)}

    def snapshot(self):
        """Publish the next version: every rank takes part in assembling full Hugging Face tensors
        on rank 0 (weight_sync.gather_hf), where the sender stages them for the engines' refreshes;
        other ranks return None."""
        self.version += 1
        return self.publish(self.version)

    def publish(self, version: int):
        """Publish the weights as `version` (0: the checkpoint's, before any step): separate pools
        assemble them on rank 0 alone, colocated pools on every rank (each feeds the engine worker
        on its NPU)."""
        local = {k: v for k, v in self.model.module.state_dict().items() if isinstance(v, torch.Tensor)}
        if self.stage["config"].get("moe_grouped_gemm"):
            local = grouped_to_sequential(self.sync.arch, local, self.sync.parallel.ep)
        assemble = whole_hf_in_place if self.sync.colocated else gather_hf
        tensors = assemble(self.sync.arch, local, self.sync.parallel, self.sync.comm, self.sync.layout)
        return self.sync.sender.publish(version, tensors) if self.sync.sender is not None else None

    def send_weights(self, version: int, instance: int) -> None:
        """Send staged version `version` to one instance. Separate pools: rank 0 alone broadcasts it
        (an engine's HandleSender asks, weight_sync.py). Colocated pools: every rank, together (rank 0's
        IpcSender broadcasts this call to the others before its NPU IPC send)."""
        self.sync.sender.wait(self.sync.sender.start(version, instance))

    def _logprobs(self, model, rollouts: list) -> dict:
        """Sample key -> its response tokens' log-probs under `model` (forward only)."""
        with torch.no_grad():
            out = {}
            for mb in pack(rollouts, self.stage["micro_batching"]["tokens"]):
                logp = token_logprobs(model(mb.input_ids, mb.position_ids, mb.attention_mask), mb.labels)
                out.update(per_sequence(logp, mb))
            return out


# ---- offload and onload for time-shared pools ----
def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if tensor.device.type != "cpu" else host


def offload_buffer(buffer) -> list:
    """One of megatron DDP's contiguous buffers (`param_data`, `grad_data`; the parameters and
    their .main_grad are views into them): the parameters to host memory, the device storage
    released (resized to 0, so the views stay valid); gradients dropped (zero after the optimizer
    step). Returns the restore step."""
    params, grads = buffer.param_data, buffer.grad_data
    host, sizes = _host_copy(params), (params.untyped_storage().size(), grads.untyped_storage().size())
    params.untyped_storage().resize_(0)
    grads.untyped_storage().resize_(0)

    def restore() -> None:
        params.untyped_storage().resize_(sizes[0])
        params.copy_(host)
        grads.untyped_storage().resize_(sizes[1])
        grads.zero_()

    return [restore]


def offload_model(ddp) -> list:
    """Every parameter and gradient buffer of a DDP-wrapped megatron model (dense and expert)."""
    return [step for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers] for step in offload_buffer(buffer)]


def offload_optimizer(optimizer, ddp) -> list:
    """The fp32 main parameters and Adam state of megatron's optimizer (each chained optimizer's
    torch optimizer, as megatron-core 0.16's MegatronOptimizer.offload_to_cpu moves them; 0.12.1,
    MindSpeed's megatron, has no such method), to host memory; model parameters shared with the
    optimizer (no mixed precision) stay with the model's buffers."""
    model_params = {id(p) for p in ddp.parameters()}
    steps = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        for group in torch_optimizer.param_groups:
            steps += [_move_data(p) for p in group["params"] if id(p) not in model_params]
        for state in torch_optimizer.state.values():
            steps += [_move_entry(state, key) for key, value in state.items() if isinstance(value, torch.Tensor)]
    return steps


def _move_data(param: torch.Tensor):
    device, param.data = param.device, _host_copy(param.data)

    def restore() -> None:
        param.data = param.data.to(device)

    return restore


def _move_entry(state: dict, key: str):
    device, state[key] = state[key].device, _host_copy(state[key])

    def restore() -> None:
        state[key] = state[key].to(device)

    return restore


def empty_device_cache() -> None:
    """Give freed device memory back (torch_npu's caching allocator keeps it otherwise)."""
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.empty_cache()


def per_sequence(logp: torch.Tensor, mb: MicroBatch) -> dict:
    """Sample key -> its response tokens' values in a packed row's per-position tensor [1, T]."""
    return {key: logp[0, first:end].tolist() for key, (first, end) in zip(mb.keys, mb.spans)}


def compile_forward(model, compiler: dict):
    """torch.compile with torchair's NPU backend (GE graph mode, static shapes) for forward-only
    executors (reference, reward model) whose launch stage carries a torchair config."""
    import torchair

    from aspc.backends.ascend.compiler_options import apply_compiler_options

    config = apply_compiler_options(torchair.CompilerConfig(), compiler)
    return torch.compile(model, backend=torchair.get_npu_backend(compiler_config=config),
                         dynamic=compiler.get("dynamic", False))


# ---- one job, many ranks: rank 0 leads, the others follow ----
# every rank must run these (offload/onload: each rank moves its own share)
MODEL_CALLS = ("reference", "values", "train", "optimizer_step", "snapshot", "publish", "offload", "onload")
# a model call's broadcast and its collectives in one piece: colocated weight sends (weight_sync.IpcSender)
# broadcast from another thread of rank 0
CALLS = threading.RLock()


class Leader:
    """Rank 0's trainer as the driver's learner actor sees it: a call that touches the model is
    first broadcast to the job's other ranks, which run the same call (megatron's collectives need
    every rank, in the same order); host-only calls (rewards) run here alone."""

    def __init__(self, trainer, broadcast=None):
        self.trainer, self.broadcast = trainer, broadcast or broadcast_call

    def __getattr__(self, name):
        if name not in MODEL_CALLS:
            return getattr(self.trainer, name)

        def call(*args):
            with CALLS:
                self.broadcast((name, args))
                return getattr(self.trainer, name)(*args)

        return call

    def close(self) -> None:
        self.broadcast(("stop", ()))


def follow(trainer, receive=None) -> int:
    """Ranks other than 0: run rank 0's calls until it stops; how many ran."""
    receive = receive or broadcast_call
    count = 0
    while True:
        name, args = receive(None)
        if name == "stop":
            return count
        getattr(trainer, name)(*args)
        count += 1


def broadcast_call(call):
    """Rank 0 sends `call`, every other rank receives it (torch.distributed's default group)."""
    import torch.distributed as dist

    box = [call]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_checkpoint(model, stage: dict, checkpoint: str | None = None, value_head: bool = False):
    """`model` (this rank's GPTModel of `stage`) with its share of the Hugging Face checkpoint
    (load_hf.py): the stage's own (`builders.checkpoint`) unless `checkpoint` names another; a
    critic's `value_head` stays freshly initialised."""
    from aspc.backends.ascend.load_hf import load_rank_weights, parallel_coords

    c = stage["config"]
    arch, parallel, _ = layout_of(stage, c["tensor_model_parallel_size"] * c["pipeline_model_parallel_size"]
                                  * c["context_parallel_size"])  # data parallelism does not cut weights
    layout = Layout.from_config(c, value_head=value_head)
    load_rank_weights(model, checkpoint or stage["builders"]["checkpoint"], arch, parallel, layout,
                      parallel_coords())
    return model


def reference_checkpoint(stages: list[dict], train: dict) -> str | None:
    """The checkpoint directory of the plan's reference model (a `reference` launch stage; for
    frozen(actor), the actor's), or None without one. The frozen reference is built in the trainer's
    processes, on its parallel layout, so it must have the policy's architecture."""
    found = next((s for s in stages if s["kind"] == "reference"), None)
    if found is None:
        return None
    if arch_of(found) != arch_of(train):
        raise ValueError(f"stage '{found['stage']}': the reference model's architecture differs from the "
                         "policy's; the NPU trainer builds its frozen reference on the policy's ranks and layout: "
                         "use frozen(<policy model>) or a checkpoint of the same architecture")
    return found["builders"]["checkpoint"]


def frozen_reference(stage: dict, rank_args: dict, checkpoint: str | None):
    """The reference policy on this rank (every rank builds it, in the same order): a second GPTModel
    of the train stage, eval mode, no gradients, loaded from the reference's checkpoint (verl's
    megatron reference policy); None without a reference stage."""
    if checkpoint is None:
        return None
    model = load_checkpoint(build_gpt(stage, rank_args), stage, checkpoint).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_forward_model(stage: dict, rank_args: dict):
    """A forward-only model (reference, reward model): this rank's GPTModel in eval mode, compiled
    with torchair where the launch stage carries a `compiler` config (GE graph mode, static shapes:
    the pack pass's buckets)."""
    model = build_gpt(stage, rank_args).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return compile_forward(model, stage["compiler"]) if stage.get("compiler") else model
