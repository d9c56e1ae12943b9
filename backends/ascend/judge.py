"""An LLM judge on NPUs (RLAIF): the engine-free judge of aspc/rl/judge_verdict.py (`VerdictJudge`, which
the CPU judge is too) with its model served by a vllm-ascend engine with the launch plan's judge
arguments. The verdict judge builds every
prompt (a custom judge: `judge_input`, BOS + rubric + prompt + response + "#" in the character
vocabulary; a checkpoint judge: its chat template in its own tokenizer, judge_prompt.py) and reads
the verdict (read = "probability": P("1") / (P("1") + P("0")); read = "verdict": the greedy token
parsed, anything but "1" or "0" a JudgeCallFailed), "1" and "0" being the judge tokenizer's tokens;
here only the logits at the verdict position come from vLLM instead of a CPU forward pass.

The engine runs greedy with the plan's sampling (`micro_batching.sampling`: temperature 0, the
verdict's max_tokens, the top-5 log-probs); the log-probs of the first generated position
(vLLM's raw log-softmax, ModelConfig.logprobs_mode "raw_logprobs") stand for the logits there: a
softmax over "0" and "1" and the argmax read the same from log-probs as from logits. What vLLM does
not return (outside the top 5) is -inf: read = "probability" then gives 1.0 or 0.0 when one verdict
token is outside, and a judge whose top 5 holds neither verdict token fails the call
(JudgeCallFailed), where the CPU judge would still read a probability from them.

Calls follow vLLM 0.23.0 as engine_actor.py does (`LLM.llm_engine.add_request` / `step`, a
TokensPrompt, `RequestOutput.outputs[0].logprobs[0]`: token id -> Logprob). Concurrent calls share
the one engine (continuous batching): each adds its requests, and whoever holds the engine steps
it for everyone."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import torch

from aspc.rl.judge_verdict import NO, YES, JudgeCallFailed, VerdictJudge


def judge_api():
    """vLLM's LLM and SamplingParams (on an NPU host, vllm-ascend registers itself as the platform)."""
    from vllm import LLM, SamplingParams

    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams)


class VerdictEngine:
    """One judge instance's vLLM engine. `launch`: the judge stage of the launch plan (`config`: the
    LLM arguments; `micro_batching.sampling`); `api`: judge_api() on an NPU, a fake in the CPU tests."""

    def __init__(self, launch: dict, api=None, env: dict | None = None):
        self.launch, self.api, self._llm, self.env = launch, api, None, dict(env or {})
        self.sampling = dict(launch["micro_batching"]["sampling"])
        self.lock = threading.Lock()
        self.done: dict[str, dict] = {}  # request id -> the first position's {token id: log-prob}
        self.submitted = 0

    @property
    def llm(self):
        if self._llm is None:
            self.api = self.api or judge_api()
            os.environ.update(self.env)
            self._llm = self.api.LLM(**self.launch["config"])
        return self._llm

    def first_logprobs(self, prompts: list[list[int]]) -> list[dict]:
        """Each prompt's greedy continuation, read at its first position: {token id: log-prob}."""
        with self.lock:
            ids = [self._add(prompt) for prompt in prompts]
        while True:
            with self.lock:
                if all(i in self.done for i in ids):
                    return [self.done.pop(i) for i in ids]
                self._step()

    def _add(self, prompt: list[int]) -> str:
        request_id, self.submitted = f"judge-{self.submitted}", self.submitted + 1
        engine = self.llm.llm_engine  # started first: it brings vLLM's API
        s = self.sampling
        params = self.api.SamplingParams(temperature=s["temperature"], max_tokens=s["max_tokens"],
                                         logprobs=s["logprobs"])
        engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        return request_id

    def _step(self) -> None:
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            raise RuntimeError("the judge's engine holds no request, but calls wait for verdicts")
        for out in engine.step():
            if out.finished:
                positions = out.outputs[0].logprobs or [{}]
                self.done[out.request_id] = {token: lp.logprob for token, lp in positions[0].items()}


class VerdictModel:
    """The judge model at the verdict position: the engine's log-probs there ([B, V], -inf for what
    it does not return), for each input as the CPU judge built it. `yes`, `no`: the verdict tokens."""

    def __init__(self, engine: VerdictEngine, max_seq: int, vocab: int, yes: int, no: int):
        self.engine, self.arch, self.vocab, self.verdicts = engine, SimpleNamespace(max_seq=max_seq), vocab, (yes, no)

    def eval(self):
        return self

    def at_verdict(self, inputs: list[list[int]]) -> torch.Tensor:
        found = self.engine.first_logprobs(inputs)
        at_verdict = torch.full((len(inputs), self.vocab), float("-inf"))
        for i, logprobs in enumerate(found):
            if not any(token in logprobs for token in self.verdicts):
                raise JudgeCallFailed(f"the judge's top {len(logprobs)} verdict tokens {sorted(logprobs)} hold "
                                      'neither "1" nor "0"')
            for token, logprob in logprobs.items():
                if token < self.vocab:
                    at_verdict[i, token] = logprob
        return at_verdict


class NpuJudge(VerdictJudge):
    """The judge's prompts and reading of the verdict (aspc/rl/judge_verdict.py, as the CPU judge's)
    with the logits from the engine."""

    def verdict_logits(self, inputs: list[list[int]]) -> torch.Tensor:
        return self.model.at_verdict(inputs)


def judge_prompt(spec: dict):
    """The prompt the spec's judge reads: the character vocabulary's (a custom judge: None, CpuJudge's
    default), or the judge checkpoint's tokenizer (the launch plan's vLLM model directory) with the
    policy's tokenizer decoding the responses (its checkpoint directory; the characters for a custom
    policy)."""
    if spec.get("tokenizer") is None:
        return None
    from pathlib import Path

    from aspc.rl.hf_tokenizer import HfTokenizer
    from aspc.rl.judge_prompt import TokenizerPrompt
    from aspc.rl.tokenizer import CHARS

    policy = HfTokenizer(Path(spec["policy_tokenizer"])) if spec.get("policy_tokenizer") else CHARS
    return TokenizerPrompt(HfTokenizer(Path(spec["tokenizer"])), policy, spec["rubric"], spec["max_seq"])


def build(spec: dict, api=None) -> NpuJudge:
    """In the judge's own process (scorer_process.py), on its NPUs: the CPU judge over the engine."""
    if api is None:
        from aspc.backends.ascend.executors import require_npu

        require_npu()
    prompt = judge_prompt(spec)
    yes, no = (prompt.yes, prompt.no) if prompt is not None else (YES, NO)
    engine = VerdictEngine(spec["stage"], api)  # its environment: the process's (scorer_process.py)
    model = VerdictModel(engine, spec["max_seq"], spec["vocab"], yes, no)
    return NpuJudge(model, spec["rubric"], spec["read"], prompt)
