"""Reward models and LLM judges on NPUs (backends/ascend/scorers.py) on CPU: the megatron reward
model's reading (a CPU stand-in for megatron's GPTModel under the real one-unit head) against the CPU
reward model; the judge over a fake vLLM engine against the CPU judge, for the same verdicts; the
scorer's own process (scorer_process.py) with a light fake term; and what is refused at the stage."""
import dataclasses
import math
import os
import threading
from functools import cache
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from aspc.backends.ascend import judge as npu_judge
from aspc.backends.ascend import scorers
from aspc.backends.ascend.critic import ValueHead
from aspc.backends.ascend.load_hf import CheckpointError
from aspc.backends.ascend.lowering import lower
from aspc.backends.ascend.process_env import resolved
from aspc.backends.ascend.reward_model import NpuRewardModel, load_score_head
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.ascend.scorer_process import ScorerFailed, ScorerProcess
from aspc.backends.cpu.executors import CpuExecutors
from aspc.rl.hf_tokenizer import HfTokenizer
from aspc.backends.cpu.judge import CpuJudge, load_judge
from aspc.rl.judge_verdict import NO, YES, JudgeCallFailed, judge_input
from aspc.rl.judge_prompt import TokenizerPrompt
from aspc.rl.rollout import Rollout
from aspc.backends.cpu.model import TinyQwen
from aspc.backends.cpu.reward_model import load_reward_model
from aspc.rl.scoring import RewardScorer
from aspc.rl.rollout import Shaping
from aspc.rl.tokenizer import BOS, CHARS, EOS, encode
from aspc.cli.toolchain import compile_with_passes
from conftest import ROOT
from npu_scorer_fakes import GptStandIn, fake_api, model_first_position
from test_ascend_conformance import vllm  # noqa: F401 (a fixture)
from test_ascend_executors import one_rank  # noqa: F401 (a fixture)

PIPELINES = ROOT / "pipelines"
RLHF, RLAIF = PIPELINES / "tiny_rlhf.aspl", PIPELINES / "tiny_rlaif.aspl"


def rollout(prompt: str, response: str, key=0, answer="") -> Rollout:
    return Rollout([BOS] + encode(prompt), encode(response) + [EOS], [0.0] * (len(response) + 1), prompt, answer,
                   key=key)


ITEMS = [("9+9=", "18"), ("9+9=", "17"), ("4+4=", "8"), ("37+5=", "043"), ("1+2=", ""),
         ("12+30=", "4" * 70)]  # the last one longer than the models' max_seq: cut as the CPU cuts it


def items():
    return [rollout(p, r, key=(0, i)) for i, (p, r) in enumerate(ITEMS)]


# ---- the reward model ----
def cpu_reward_model():
    plan = compile_with_passes(RLHF, []).plan()
    return plan, load_reward_model(plan.model("rm").arch, PIPELINES / "data" / "tiny_rm.safetensors", "rm")


def test_the_npu_reward_model_scores_as_the_cpu_reward_model():
    """Same weights, same sequences (one longer than max_seq): the last-token values through the
    one-unit head, one sequence per forward (the plan's packing "none"), equal the CPU reward model
    scoring each sequence alone within 1e-6; its padded batch differs from that by float32 rounding
    of other matrix shapes only (up to 2e-5 here), so against the batch the bound is 5e-5."""
    plan, cpu = cpu_reward_model()
    npu = NpuRewardModel(GptStandIn(cpu.decoder), plan.model("rm").arch.max_seq)
    pairs = [(r.prompt, r.response) for r in items()]
    scored = npu.scores(items())
    assert scored == pytest.approx([cpu([pair]).item() for pair in pairs], abs=1e-6)
    assert scored == pytest.approx(cpu(pairs).tolist(), abs=5e-5)
    assert len(set(round(s, 4) for s in scored)) > 3  # the scores differ: the comparison means something


def test_the_score_head_comes_from_the_checkpoints_score_weight(tmp_path):
    head = ValueHead(8)
    weight = torch.randn(1, 8)
    save_file({"score.weight": weight, "model.norm.weight": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    load_score_head(head, tmp_path)
    assert torch.equal(head.weight.data, weight) and torch.equal(head.bias.data, torch.zeros(1))
    save_file({"score.weight": torch.randn(2, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="one label"):
        load_score_head(head, tmp_path)


@cache
def cpu_with_launch(path):
    """The CPU backend's executors of a tiny pipeline, with the launch plan AscendExecutors holds."""
    plan = compile_with_passes(path, []).plan()
    executors = CpuExecutors(plan, path.parent)
    executors.launch = lower(plan, path.parent)
    return executors


def test_a_reward_stage_instance_is_the_cpu_scorer_with_the_reward_model_in_its_process(monkeypatch):
    """stage_scorer: the rewards (and overlong shaping) of the CPU backend's forward model; the
    reward model's process gets the launch plan's environment of the stage's rank 0 and builds the
    last pipeline stage with its head."""
    executors = cpu_with_launch(RLHF)
    specs = []

    def start_term(spec):
        specs.append(spec)
        return NpuRewardModel(GptStandIn(executors.reward_models["rm"].decoder), spec["max_seq"])

    monkeypatch.setattr(scorers, "start_term", start_term)
    ours, theirs = items(), items()
    scorers.stage_scorer(executors, "score", 0).score(ours)
    executors.forward_model("score", 0).score(theirs)
    assert [r.reward for r in ours] == pytest.approx([r.reward for r in theirs], abs=5e-5)  # see above
    [spec] = specs
    rank0 = next(p for p in executors.launch.processes if p.stage == "score")
    assert spec["role"] == "model" and spec["env"]["RANK"] == "0"
    assert spec["env"] == resolved(rank0.env)  # the socket interface resolved on this host (process_env.py)
    assert spec["rank_args"]["post_process"] is True and spec["stage"]["role"] == "megatron-forward"


# ---- the judge over a fake vLLM ----
def judge_spec(read="probability"):
    executors = cpu_with_launch(RLAIF)
    source = next(s for s in dict(executors.plan.stage("score").options)["sources"] if s.func == "judge")
    spec = scorers.scorer_spec(executors, "score", 0, source)
    return spec | {"read": read}, executors


@pytest.mark.parametrize("read", ["probability", "verdict"])
def test_the_npu_judge_scores_as_the_cpu_judge(read):
    """The shipped tiny judge served by the fake engine: the same prompts (the CPU judge builds them),
    the same scores for both reads, from greedy requests with the launch plan's sampling."""
    spec, _ = judge_spec(read)
    arch = compile_with_passes(RLAIF, []).plan().model("grader").arch
    model = load_judge(arch, PIPELINES / "data" / "tiny_judge.safetensors", "grader")
    cpu = CpuJudge(model, spec["rubric"], read)
    npu = npu_judge.build(spec, api=fake_api(model_first_position(model)))
    expected, scored = cpu.scores(items()[:5]), npu.scores(items()[:5])
    assert scored == pytest.approx(expected, abs=1e-6)
    assert 0 < sum(scored) < len(scored)  # right and wrong answers told apart
    llm = npu.model.engine.llm
    assert {(p.temperature, p.max_tokens, p.logprobs) for p in llm.params} == \
        {tuple(spec["stage"]["micro_batching"]["sampling"][k] for k in ("temperature", "max_tokens", "logprobs"))}
    assert llm.engine_args == spec["stage"]["config"]


def scripted(*positions):
    """A fake engine whose first positions are given log-probs, in request order."""
    answers = iter(positions)

    def first_position(ids):
        row = torch.full((64,), -30.0)
        for token, logprob in next(answers).items():
            row[token] = logprob
        return row

    return fake_api(first_position)


def test_scripted_verdicts_score_as_the_cpu_judge_reads_them():
    spec, _ = judge_spec("probability")
    two = items()[:2]
    npu = npu_judge.build(spec, api=scripted({YES: -0.2, NO: -1.8}, {NO: -0.1, 7: -2.5}))
    assert npu.scores(two) == pytest.approx([torch.softmax(torch.tensor([-1.8, -0.2]), 0)[1].item(), 0.0])
    verdicts = npu_judge.build(spec | {"read": "verdict"}, api=scripted({YES: -0.1}, {NO: -0.3}))
    assert verdicts.scores(two) == [1.0, 0.0]


def test_a_verdict_the_cpu_judge_cannot_read_fails_the_call_as_on_the_cpu():
    spec, _ = judge_spec("verdict")
    not_a_verdict = npu_judge.build(spec, api=scripted({encode("5")[0]: -0.1, NO: -2.0}))
    with pytest.raises(JudgeCallFailed, match="not a verdict"):
        not_a_verdict.scores(items()[:1])
    neither = npu_judge.build(spec | {"read": "probability"}, api=scripted({encode("5")[0]: -0.1}))
    with pytest.raises(JudgeCallFailed, match='neither "1" nor "0"'):
        neither.scores(items()[:1])


class LeaningToVerdicts(torch.nn.Module):
    """A random judge whose logits at every position favour the verdict tokens (so the top 5 the
    engine returns hold both, and the two backends read the same): its own scores differ per input."""

    def __init__(self, arch, verdicts):
        super().__init__()
        self.inner, self.arch = TinyQwen(arch, seed=11), arch
        self.lean = torch.zeros(arch.vocab)
        self.lean[list(verdicts)] = 6.0

    def forward(self, tokens, positions, mask):
        return self.inner(tokens, positions, mask) + self.lean


@pytest.mark.parametrize("read", ["probability", "verdict"])
def test_a_checkpoint_judge_reads_the_verdict_of_its_own_tokenizer_as_the_cpu_judge(tmp_path, read):
    """A judge with a Hugging Face tokenizer (a byte-level BPE with a ChatML template, built here):
    the NPU judge sends the engine its chat-templated message (rubric, problem, the response decoded
    by the policy's tokenizer) and reads that tokenizer's "1" and "0", scoring as the CPU judge with
    the same prompt and model does."""
    from test_hf_checkpoints import save_tokenizer

    save_tokenizer(tmp_path / "judge")
    tokenizer = HfTokenizer(tmp_path / "judge")
    spec, _ = judge_spec(read)
    arch = dataclasses.replace(compile_with_passes(RLAIF, []).plan().model("grader").arch,
                               vocab=len(tokenizer.inner), max_seq=96)
    prompt = TokenizerPrompt(tokenizer, CHARS, "Is it right?", arch.max_seq)
    assert (prompt.yes, prompt.no) == tuple(tokenizer.encode(t)[0] for t in "10") and prompt.yes != YES
    model = LeaningToVerdicts(arch, (prompt.yes, prompt.no)).eval()
    odds = sorted(CpuJudge(model, "", "probability", prompt).scores(items()))[len(ITEMS) // 2 - 1:][:2]
    model.lean[prompt.yes] -= math.log(sum(odds) / (2 - sum(odds)))  # even odds between the middle two: both verdicts
    spec |= {"tokenizer": str(tmp_path / "judge"), "policy_tokenizer": None, "rubric": "Is it right?",
             "vocab": arch.vocab, "max_seq": arch.max_seq}
    npu = npu_judge.build(spec, api=fake_api(model_first_position(model)))
    expected = CpuJudge(model, "Is it right?", read, prompt).scores(items())
    assert npu.scores(items()) == pytest.approx(expected, abs=1e-6)
    assert len(set(expected)) > 1
    sent = [tokenizer.inner.decode(ids) for ids in npu.model.engine.llm.prompts]
    assert sent[0] == "<|im_start|>user\nIs it right?\n\nProblem: 9+9=\n\nResponse: 18<|im_end|>\n" \
                      "<|im_start|>assistant\n"
    assert all(len(ids) <= arch.max_seq for ids in npu.model.engine.llm.prompts)  # the long one cut
    assert sent[-1].endswith("<|im_start|>assistant\n") and "Response: 4444" in sent[-1]


def test_a_checkpoint_judges_prompt_is_built_in_its_vllm_model_directorys_tokenizer():
    plan = compile_with_passes(PIPELINES / "rlaif_7b_judge.aspl", []).plan()
    executors = SimpleNamespace(plan=plan, train_stage=plan.stages_of("train")[0], base_dir=PIPELINES)
    source = next(s for s in dict(plan.stage("score").options)["sources"] if s.func == "judge")
    found = scorers.judge_tokenizers(executors, source, {"config": {"model": "/ckpt/qwen2.5-32b"}})
    assert found == {"tokenizer": "/ckpt/qwen2.5-32b", "policy_tokenizer": None}
    assert judge_spec()[0]["tokenizer"] is None  # a custom judge: the character vocabulary


def test_concurrent_judge_calls_share_one_engine():
    spec, _ = judge_spec("verdict")
    npu = npu_judge.build(spec, api=fake_api(lambda ids: torch.nn.functional.one_hot(
        torch.tensor(YES if len(ids) % 2 else NO), 64).float().log()))
    found = {}
    threads = [threading.Thread(target=lambda i=i: found.update({i: npu.scores([items()[i]])})) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    lengths = [len(judge_input(encode(spec["rubric"]), r.prompt, r.response, spec["max_seq"])) for r in items()[:5]]
    assert found == {i: [1.0 if length % 2 else 0.0] for i, length in enumerate(lengths)}
    assert not npu.model.engine.done and len(set(lengths)) > 1


def test_an_engine_error_fails_the_call_for_the_drivers_failure_policy():
    spec, executors = judge_spec()

    def broken(ids):
        raise RuntimeError("ACL stream error 507015")

    scorer = RewardScorer([(npu_judge.build(spec, api=fake_api(broken)), 1.0)], Shaping(0, 0))
    with pytest.raises(RuntimeError, match="507015"):
        scorer.judge(items()[:1])


# ---- the scorer's own process ----
def fake_process(**spec):
    tests = str(ROOT / "tests")
    env = {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    return ScorerProcess({"offset": 100, **spec}, "scorer_fakes:build", "judge(grader) of stage 'score'", env)


def test_a_scorer_process_answers_concurrent_calls_and_reports_failures_as_the_cpu_path():
    process = fake_process()
    try:
        waiting = {}
        slow = threading.Thread(target=lambda: waiting.update(slow=process.scores([rollout("1+1=", "2")]
                                                                                   + [SimpleNamespace(prompt=[1],
                                                                                                      response=[97])])))
        slow.start()
        assert process.scores([rollout("1+1=", "22")]) == [100 + 5 + 3]  # answered while the slow call waits
        slow.join(10)
        assert waiting["slow"] == [100 + 5 + 2, 102]
        with pytest.raises(JudgeCallFailed, match="not a verdict"):
            process.scores([SimpleNamespace(prompt=[1], response=[99])])
        with pytest.raises(ScorerFailed, match="exit code 3"):
            process.scores([SimpleNamespace(prompt=[1], response=[98])])
    finally:
        process.close()


def test_closing_a_scorer_process_ends_it_after_closing_its_term(tmp_path):
    """`close`: the child stops serving, closes its term (a reward model's other ranks stop) and ends."""
    process = fake_process(closed=str(tmp_path / "closed"))
    assert process.scores([rollout("1+1=", "2")]) == [100 + 5 + 2]
    process.close()
    assert process.child.poll() == 0 and (tmp_path / "closed").read_text() == "1"


def test_a_scorer_that_cannot_start_says_why():
    with pytest.raises(ScorerFailed, match="could not start: FileNotFoundError: no checkpoint directory"):
        fake_process(fail=True)


# ---- what is refused ----
def pipelined_reward_model(tmp_path):
    """rlhf_32b_rm with its reward model cut into two pipeline stages (not served)."""
    text = (PIPELINES / "rlhf_32b_rm.aspl").read_text().replace("{ tp = 4, instances = 2 }", "{ tp = 2, pp = 2, "
                                                                "instances = 2 }")
    (tmp_path / "rlhf_32b_rm.aspl").write_text(text)
    return tmp_path / "rlhf_32b_rm.aspl"


def score_refusals(path, *overrides):
    plan = compile_with_passes(path, list(overrides)).plan()
    return [r for r in AscendExecutors.unsupported(plan) if r.stage == "score"]


def test_the_tiny_reward_model_and_judge_stages_are_no_longer_refused():
    assert score_refusals(RLHF) == [] and score_refusals(RLAIF) == []


def test_what_the_npu_scorers_cannot_serve_is_refused_at_the_score_stage(tmp_path):
    assert score_refusals(PIPELINES / "rlhf_32b_rm.aspl") == []  # tp = 4: rank 0 leads, the others follow
    [pipelined] = score_refusals(pipelined_reward_model(tmp_path))
    assert "pp = 2" in pipelined.message and "tp only" in pipelined.hint and pipelined.option == "pp"
    assert score_refusals(PIPELINES / "rlaif_7b_judge.aspl") == []  # its judge reads its own tokenizer
    both = RLAIF.read_text().replace('python("tiny_rewards:well_formed", weight = 0.1)', "model(model = grader)")
    (tmp_path / "both.aspl").write_text(both)
    (tmp_path / "tiny_rewards.py").write_text((PIPELINES / "tiny_rewards.py").read_text())
    [two] = score_refusals(tmp_path / "both.aspl")
    assert "2 model(...)/judge(...) sources" in two.message


def test_a_scorer_on_another_node_is_refused_when_it_starts(monkeypatch):
    executors = cpu_with_launch(RLHF)
    executors.launch = dataclasses.replace(executors.launch, processes=tuple(  # the score pool on a node of its own
        dataclasses.replace(p, node=1) if p.stage == "score" else p for p in executors.launch.processes))
    monkeypatch.setenv("ASPC_NODES", "10.0.0.1,10.0.0.2")
    source = dict(executors.plan.stage("score").options)["sources"][0]
    with pytest.raises(ScorerFailed, match="node1"):
        scorers.scorer_spec(executors, "score", 0, source)
    monkeypatch.setenv("ASPC_NODES", "10.0.0.1,10.0.0.1")  # one host holds both nodes' NPUs
    assert scorers.scorer_spec(executors, "score", 0, source)["role"] == "model"


# ---- the reward model's megatron side, built on one CPU rank ----
def test_a_sequence_classifier_checkpoint_loads_into_the_score_stages_value_model(one_rank, tmp_path):  # noqa: F811
    """tiny_rlhf's lowered score stage: the last stage built with post_process (the final layernorm the
    score head reads) takes the whole checkpoint, body and `score.weight`; built as the launch plan's
    post_process=False says, megatron has no final layernorm, and the checkpoint's does not fit."""
    from aspc.backends.ascend import reshard
    from aspc.backends.ascend.critic import value_model
    from aspc.backends.ascend.megatron_model import arch_of, load_checkpoint

    executors = cpu_with_launch(RLHF)
    source = dict(executors.plan.stage("score").options)["sources"][0]
    spec = scorers.scorer_spec(executors, "score", 0, source)
    stage, arch = spec["stage"], arch_of(spec["stage"])
    layout = reshard.Layout.from_config(stage["config"], value_head=True)
    full = {name: torch.randn(shape, generator=torch.Generator().manual_seed(5))
            for name, shape in reshard.full_shapes(arch, layout).items()}
    save_file({k: v.contiguous() for k, v in reshard.to_hf(arch, full, layout).items()},
              str(tmp_path / "model.safetensors"))
    model = load_checkpoint(value_model(stage, spec["rank_args"], use_cpu_initialization=True), stage,
                            str(tmp_path), value_head=True)
    load_score_head(model.output_layer, tmp_path)
    assert torch.equal(model.decoder.final_layernorm.weight, full["decoder.final_layernorm.weight"])
    assert torch.equal(model.output_layer.weight, full["output_layer.weight"])
    as_lowered = value_model(stage, {**spec["rank_args"], "post_process": False}, use_cpu_initialization=True)
    assert as_lowered.decoder.final_layernorm is None
    with pytest.raises(CheckpointError, match="final_layernorm"):
        load_checkpoint(as_lowered, stage, str(tmp_path), value_head=True)


# ---- conformance: what the AST check of test_ascend_conformance cannot follow ----
def engine_calls() -> tuple[set, set]:
    """judge.py's calls on vLLM's engine (`engine = self.llm.llm_engine`) and SamplingParams' keywords."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(npu_judge))
    engine = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "engine"}
    keywords = {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
                "SamplingParams" for k in n.keywords}
    return engine, keywords


def test_the_judges_engine_calls_exist_in_vllm(vllm):  # noqa: F811
    """judge.py is in the conformance check's files (it imports vllm): LLM(...) and `self.llm.X` are
    checked there; the engine's methods and SamplingParams' fields, which it cannot follow, here."""
    from test_ascend_conformance import executor_files
    from wheel_sources import dataclass_fields

    assert ROOT / "backends" / "ascend" / "judge.py" in executor_files()
    engine, keywords = engine_calls()
    assert engine == {"add_request", "step", "has_unfinished_requests"}
    assert engine <= vllm.members("LLMEngine"), engine - vllm.members("LLMEngine")
    assert keywords and keywords <= dataclass_fields(vllm, "vllm.sampling_params", "SamplingParams")
    assert {"request_id", "finished", "outputs"} <= vllm.members("RequestOutput")
    assert "logprobs" in vllm.members("CompletionOutput") and "logprob" in vllm.members("Logprob")


def test_aspc_run_points_at_the_score_stage_it_cannot_serve(aspc, monkeypatch, tmp_path):
    """The CLI's NPU path (doctor passed) refuses a pipelined reward model at its line."""
    from test_ascend_executors import fake_platform

    fake_platform(monkeypatch)
    path = pipelined_reward_model(tmp_path)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("stage score"))
    result = aspc("run", str(path), "--backend", "ascend", "--warmstart", "0", "--steps", "1")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"rlhf_32b_rm.aspl:{line}:" in result.output and "tp only" in result.output
