"""The stage-kind table: one row per kind of stage, read by every layer.

What a stage of each kind receives and sends, whether it needs a model, data and devices, how the
controller moves its work (dispatched, streamed, packed), which executor role runs it, how the
simulator prices it and how a platform lowers it where that differs. The front end checks inputs
with it, the passes decide where to insert and annotate with it, the plan, the controller, the
drivers, the simulator's pricing and the Ascend lowering read it; a new kind is one new row, and
tests/test_kind_table.py checks that the layers agree with it. It lives in the IR because every
layer may import the IR and the IR imports none of them.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace


class StageKind(enum.Enum):
    GENERATE = "generate"
    ENVIRONMENT = "environment"
    REWARD = "reward"
    REFERENCE = "reference"
    CRITIC = "critic"
    ADVANTAGE = "advantage"
    TRAIN = "train"
    # inserted by passes
    CHANNEL = "channel"
    DISPATCH = "dispatch"
    WEIGHT_SYNC = "weight_sync"


@dataclass(frozen=True)
class AscendRule:
    """How the Ascend lowering runs a kind (backends/ascend/lowering.py), where it has its own executors."""

    runner: str  # "vllm-engine" | "megatron"
    megatron_role: str = ""  # "megatron-train" | "megatron-forward" (a megatron runner's processes)
    in_trainer: bool = False  # built in the train stage's processes: no processes of its own


@dataclass(frozen=True)
class KindRule:
    kind: StageKind
    requires: frozenset[str]  # fields it must receive (the front end's dataflow check)
    accepts: frozenset[str]  # fields it may receive: requires and the optional ones
    produces: str | None  # the field it sends on; None: what it receives (a pass-inserted node)
    needs_model: bool  # names a model it runs (declared in the file)
    needs_data: bool  # reads a data set's prompts
    inserted: bool  # put in by a pass, never written by a user: no plan stage of its own
    consumes: str  # the unit the controller hands it: "prompts" | "responses" | "samples" (whole
    # groups of finished samples, per streamed unit); "" for pass-inserted nodes
    role: str | None  # "generation" | "forward_model" | "judge" | "trainer" | "tool_runner"; None: host
    dispatched: bool  # a dispatch policy routes its requests to its instances (queue-aware-dispatch)
    streamed: bool  # consumes streamed units of whole groups when `stream` runs (else a barrier)
    packed: bool  # its units are packed into micro-batches (the pack pass's shapes)
    priced_as: str  # the simulator: "decode" | "forward" | "judge" | "train" | "episode" (turns and
    # tool waits inside the generation instances) | "host" (no device time) | "sync" | "none"
    before_train: bool = False  # the controller routes each unit through it before training
    role_call: str | None = None  # the trainer-role method a driver calls on a unit of it
    ascend: AscendRule | None = None  # the Ascend lowering's executors; None: nothing launched

    @property
    def on_devices(self) -> bool:
        return self.role is not None


def _user(kind: StageKind, requires: set[str], produces: str, consumes: str, role: str | None, *,
          accepts: set[str] = frozenset(), needs_model: bool = False, needs_data: bool = False,
          dispatched: bool = False, streamed: bool = False, packed: bool = False, priced_as: str = "host",
          before_train: bool = False, role_call: str | None = None, ascend: AscendRule | None = None) -> KindRule:
    return KindRule(kind, frozenset(requires), frozenset(requires | accepts), produces, needs_model, needs_data,
                    inserted=False, consumes=consumes, role=role, dispatched=dispatched, streamed=streamed,
                    packed=packed, priced_as=priced_as, before_train=before_train, role_call=role_call, ascend=ascend)


def _inserted(kind: StageKind, priced_as: str) -> KindRule:
    return KindRule(kind, requires=frozenset(), accepts=frozenset(), produces=None, needs_model=False,
                    needs_data=False, inserted=True, consumes="", role=None, dispatched=False, streamed=False,
                    packed=False, priced_as=priced_as)


_K = StageKind
_ROWS = (
    _user(_K.GENERATE, set(), "responses", "prompts", "generation", needs_model=True, needs_data=True,
          dispatched=True, priced_as="decode", ascend=AscendRule("vllm-engine")),
    # Episodes run inside the generation instance that holds their KV (sticky): a model turn, a tool
    # call on the tool runners, the observation appended, the next turn (aspc/controller/episodes.py).
    # The generate stage's dispatch places them; they have no dispatch of their own.
    _user(_K.ENVIRONMENT, {"responses"}, "responses", "responses", "tool_runner", priced_as="episode"),
    # A rule or python source scores on the host; model() and judge() sources: REWARD_MODEL, JUDGE below.
    # Its units go to a free executor of the stage (no dispatch policy routes them).
    _user(_K.REWARD, {"responses"}, "rewards", "samples", None, streamed=True, before_train=True,
          role_call="reward"),
    _user(_K.REFERENCE, {"responses"}, "ref_logprobs", "samples", "trainer", needs_model=True, streamed=True,
          packed=True, priced_as="forward", before_train=True, role_call="reference",
          ascend=AscendRule("megatron", "megatron-forward", in_trainer=True)),
    _user(_K.CRITIC, {"responses"}, "values", "samples", "trainer", needs_model=True, streamed=True, packed=True,
          priced_as="forward", before_train=True, role_call="values",
          ascend=AscendRule("megatron", "megatron-train", in_trainer=True)),
    _user(_K.ADVANTAGE, {"rewards"}, "advantages", "samples", None, accepts={"values"}, streamed=True),
    _user(_K.TRAIN, {"responses", "advantages"}, "weights", "samples", "trainer",
          accepts={"ref_logprobs", "values"}, needs_model=True, streamed=True, packed=True, priced_as="train",
          role_call="train", ascend=AscendRule("megatron", "megatron-train")),
    _inserted(_K.CHANNEL, "none"),  # its capacity is the staleness gate the controller holds
    _inserted(_K.DISPATCH, "none"),  # its policy is the controller's choice of generation instance
    _inserted(_K.WEIGHT_SYNC, "sync"),
)
KIND_RULES: dict[StageKind, KindRule] = {r.kind: r for r in _ROWS}

# The trainer-role methods drivers call on units (a worker process or actor forwards exactly these).
ROLE_CALLS = tuple(r.role_call for r in _ROWS if r.role_call is not None)

# A reward stage's rule depends on its sources: a model() source scores on the stage's pool.
REWARD_MODEL = replace(KIND_RULES[_K.REWARD], role="forward_model", priced_as="forward",
                       ascend=AscendRule("megatron", "megatron-forward"))
# A judge(...) source generates a verdict per sample on the stage's pool: a prefill of rubric,
# prompt and response and a one-token decode (backends/sim/pricing.py, RooflinePricing.judge).
JUDGE = replace(KIND_RULES[_K.REWARD], role="judge", priced_as="judge", ascend=AscendRule("vllm-engine"))


def kind_rule(kind: StageKind | str, source_funcs: Iterable[str] = ()) -> KindRule:
    """The rule of a stage of `kind`; a reward stage's depends on its sources' functions (a judge
    among them makes it a judge, else a model makes it a reward model)."""
    kind = StageKind(kind)
    funcs = set(source_funcs)
    if kind is _K.REWARD and "judge" in funcs:
        return JUDGE
    if kind is _K.REWARD and "model" in funcs:
        return REWARD_MODEL
    return KIND_RULES[kind]


def kinds_where(predicate) -> tuple[StageKind, ...]:
    """The kinds whose rule satisfies `predicate`, in the table's order."""
    return tuple(r.kind for r in _ROWS if predicate(r))
