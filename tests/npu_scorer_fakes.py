"""Stand-ins for the NPU scorers' platform on CPU (tests/test_ascend_scorers.py,
tests/test_ascend_scorer_runs.py): megatron's GPTModel over the CPU reward model's decoder, a fake
of vLLM's offline API over a judge model, and `build`, the factory a real scorer process
(backends/ascend/scorer_process.py) calls in its child to build the NPU reward model or judge
over these stand-ins. The critic tests train the same stand-in (PackedValueModel)."""
import copy
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from aspc.backends.ascend import judge as npu_judge
from aspc.backends.ascend.critic import ValueHead
from aspc.backends.ascend.reward_model import NpuRewardModel
from aspc.backends.cpu.model import causal_mask

CALLS_BEFORE_FAILING = "ASPC_TEST_SCORER_FAILS_AFTER"  # a child's term raises after this many calls


class GptStandIn(torch.nn.Module):
    """megatron's GPTModel as the reward model calls it (megatron's mask: True where masked; [B, T, 1]
    out of the output layer), over the CPU reward model's decoder, under the real ValueHead."""

    def __init__(self, decoder):
        super().__init__()
        self.body = copy.deepcopy(decoder)
        self.output_layer = ValueHead(decoder.arch.hidden)
        self.output_layer.load_state_dict(decoder.value.state_dict())
        self.body.value = None

    def forward(self, input_ids, position_ids, attention_mask):
        hidden = self.body.hidden_states(input_ids, position_ids, ~attention_mask)
        values, _ = self.output_layer(hidden.transpose(0, 1))
        return values.transpose(0, 1)


class FakeJudgeLLM:
    """vLLM's LLM as the judge engine calls it (vllm/entrypoints/llm.py, vllm/v1/engine/llm_engine.py,
    vllm/outputs.py): requests answered at the next step with the top-`logprobs` raw log-probs of
    the first position from `first_position(prompt ids)`, plus the sampled (greedy) token."""

    def __init__(self, first_position, **engine_args):
        self.first_position, self.engine_args, self.pending, self.params = first_position, engine_args, [], []
        self.prompts: list[list[int]] = []
        self.llm_engine = SimpleNamespace(add_request=self._add, step=self._step,
                                          has_unfinished_requests=lambda: bool(self.pending))

    def _add(self, request_id, prompt, params):
        self.pending.append((request_id, prompt["prompt_token_ids"], params))
        self.params.append(params)
        self.prompts.append(list(prompt["prompt_token_ids"]))

    def _step(self):
        out, self.pending = [self._answer(*request) for request in self.pending], []
        return out

    def _answer(self, request_id, ids, params):
        logprobs = self.first_position(ids)
        top = torch.topk(logprobs, params.logprobs)
        chosen = {int(t): SimpleNamespace(logprob=float(v)) for t, v in zip(top.indices, top.values)}
        greedy = int(logprobs.argmax())
        chosen[greedy] = SimpleNamespace(logprob=float(logprobs[greedy]))
        completion = SimpleNamespace(token_ids=[greedy], logprobs=[chosen])
        return SimpleNamespace(request_id=request_id, finished=True, outputs=[completion])


def fake_api(first_position):
    def sampling_params(temperature, max_tokens, logprobs):
        return SimpleNamespace(temperature=temperature, max_tokens=max_tokens, logprobs=logprobs)

    return SimpleNamespace(LLM=lambda **args: FakeJudgeLLM(first_position, **args), SamplingParams=sampling_params)


def model_first_position(model):
    """A judge checkpoint served by vLLM: log-softmax of its logits after the prompt."""
    def first_position(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], causal_mask([len(ids)], len(ids)))[0, -1]
        return torch.log_softmax(logits.float(), -1)

    return first_position


# ---- in a scorer's child process ----
class FailsAfter:
    """A term that answers `calls` calls, then raises (the run's failure path)."""

    def __init__(self, term, calls: int):
        self.term, self.calls = term, calls

    def scores(self, items):
        if self.calls <= 0:
            raise RuntimeError("ACL stream error 507015 (a test's scripted failure)")
        self.calls -= 1
        return self.term.scores(items)


def build(spec):
    """The spec's reward model or judge over the CPU stand-ins: the CPU model of the spec's
    pipeline (`pipeline`, added by the test) behind the NPU reading (NpuRewardModel, the NPU judge)."""
    from aspc.backends.cpu.judge import load_judge
    from aspc.backends.cpu.reward_model import load_reward_model
    from aspc.cli.toolchain import compile_with_passes

    torch.set_num_threads(1)  # a tiny model beside the run's own threads: one is fastest (as the CPU workers use)
    plan = compile_with_passes(spec["pipeline"], []).plan()
    model = plan.model(spec["model"])
    checkpoint = Path(spec["pipeline"]).parent / model.checkpoint
    if spec["role"] == "judge":
        judge = load_judge(model.arch, checkpoint, model.name)
        term = npu_judge.build(spec, api=fake_api(model_first_position(judge)))
    else:
        reward_model = load_reward_model(model.arch, checkpoint, model.name)
        term = NpuRewardModel(GptStandIn(reward_model.decoder), spec["max_seq"])
    fails_after = os.environ.get(CALLS_BEFORE_FAILING)
    return FailsAfter(term, int(fails_after)) if fails_after else term
