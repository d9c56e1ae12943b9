"""Agentic episodes on vLLM engines (backends/vllm/episodes.py), on CPU: one episode's turns
through EpisodeEngine over a scripted vLLM (a stop at the call, the next turn a token prompt of the
whole history), and `aspc run pipelines/tiny_agentic.aspl --backend ascend` against `--backend cpu`
with test_ascend_executors' fakes, FakeLLM honouring per-request stop tokens, budgets and seeds as
vLLM does."""
import copy
import dataclasses
import itertools
import json
import shutil
from types import SimpleNamespace

from aspc.algorithms.slots import default_slots
from aspc.backends.vllm.episodes import EpisodeEngine, EpisodeSettings, tool_format, turn_seed
from aspc.backends.ascend.run_executors import AscendExecutors
from aspc.backends.cpu.episodes import EpisodeGenerator
from aspc.backends.cpu.executors import CpuExecutors
from aspc.backends.cpu.generator import BatchGenerator, Finished
from aspc.rl.tokenizer import BOS, CHARS, EOS, decode, encode
from aspc.controller.episodes import EpisodePolicy
from conftest import ROOT
from test_ascend_executors import FakeLLM, SamplingParams, fake_platform
from wheel_sources import Sources, dataclass_fields, wheel

AGENTIC = ROOT / "pipelines" / "tiny_agentic.aspl"
COMPACT = {"format": "compact", "tools": [{"name": "calc"}]}


# ---- one episode through the engine wrapper, over a scripted vLLM ----
class ScriptedLLM:
    """vLLM's offline engine whose every request finishes at the next step with the next scripted
    output; it keeps each request's prompt ids and sampling parameters."""

    def __init__(self, outputs):
        self.outputs, self.requests, self.pending = [encode(o) if isinstance(o, str) else o for o in outputs], [], []
        self.llm_engine = SimpleNamespace(add_request=self._add_request, step=self._step)

    def _add_request(self, request_id, prompt, params):
        self.requests.append((list(prompt["prompt_token_ids"]), params))
        self.pending.append((request_id, prompt["prompt_token_ids"], self.outputs.pop(0)))

    def _step(self):
        done, self.pending = self.pending, []
        return [SimpleNamespace(request_id=rid, prompt_token_ids=ids, finished=True, outputs=[SimpleNamespace(
            token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in tokens], finish_reason="stop")])
            for rid, ids, tokens in done]


def scripted_engine(outputs, max_tokens=20, max_model_len=64, instance=0):
    launch = {"config": {"max_num_seqs": 4, "max_model_len": max_model_len},
              "micro_batching": {"sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens},
                                 "weight_refresh": None}}
    settings = EpisodeSettings(EpisodePolicy(max_turns=3, max_invalid=2), tool_format(COMPACT, CHARS), 16,
                               CHARS.eos_ids)
    api = SimpleNamespace(LLM=lambda **args: ScriptedLLM(outputs), SamplingParams=lambda **kw: SimpleNamespace(**kw))
    return EpisodeEngine(launch, instance, api, settings=settings)


def result(observation, status="ok"):
    return SimpleNamespace(status=status, observation=observation)


PROMPT = [BOS] + encode("3*4=")


def test_a_turn_stops_at_the_call_and_the_next_is_a_token_prompt_of_the_whole_history():
    engine = scripted_engine(["[3*4]", encode("12") + [EOS]])
    engine.add(("s",), PROMPT, seed=5)
    assert engine.step() == [] and not engine.busy and list(engine.held) == [("s",)]
    [call] = engine.pop_calls()
    assert (call.call.tool, call.call.arguments, call.turns, call.generated) == ("calc", "3*4", 1, 5)
    assert call.context == len(PROMPT) + 5
    first = engine.llm.requests[0][1]
    assert first.stop_token_ids == encode("]") and first.max_tokens == 20 and first.seed == 5

    assert engine.resume(("s",), result("12")) == [] and engine.busy and not engine.held
    ids, params = engine.llm.requests[1]
    assert ids == PROMPT + encode("[3*4]") + encode("(12)")  # the history as token ids, never re-encoded
    assert params.max_tokens == 20 - 5 and params.seed == turn_seed(5, 1) != 5
    [done] = engine.step()
    assert done.response == encode("[3*4](12)12") + [EOS]
    assert done.mask == [1] * 5 + [0] * 4 + [1] * 3  # the tool's tokens are out of the loss
    assert done.logprobs == [-0.5] * 5 + [0.0] * 4 + [-0.5] * 3
    assert done.episode == {"turns": 2, "invalid_in_a_row": 0, "tool_calls": 1, "ended": "answer"}
    assert not engine.busy and not engine.held and not engine.running


def test_a_malformed_call_gets_an_error_observation_without_a_tool_and_a_timeout_ends_the_episode():
    engine = scripted_engine(["]", "[2*2]"])
    engine.add(("s",), PROMPT, seed=1)
    assert engine.step() == [] and engine.busy  # "]" alone: an invalid call, "(#)" and the next turn
    assert engine.llm.requests[1][0] == PROMPT + encode("](#)")
    assert engine.step() == [] and engine.pop_calls()[0].turns == 2
    [done] = engine.resume(("s",), result("", status="timeout"))
    assert done.episode["ended"] == "tool_timeout" and len(engine.llm.requests) == 2


def test_a_moved_episode_resumes_on_another_engine_with_its_history_and_an_overlong_one_ends():
    here, there = scripted_engine(["[3*4]"]), scripted_engine(["12"], instance=1)
    here.add(("s",), PROMPT, seed=5)
    here.step()
    here.pop_calls()
    state = here.detach(("s",))
    assert not here.held and there.adopt(state, result("12")) == []
    assert there.llm.requests[0][0] == PROMPT + encode("[3*4](12)")
    short = scripted_engine(["[3*4]"], max_model_len=len(PROMPT) + 5 + 4)  # no room left after "(12)"
    short.add(("s",), PROMPT, seed=5)
    short.step()
    [done] = short.resume(("s",), result("12"))
    assert done.episode["ended"] == "budget" and len(short.llm.requests) == 1


def test_the_sampling_parameters_and_token_prompt_exist_in_vllm():
    """What EpisodeEngine hands vLLM per turn: SamplingParams keywords (stop_token_ids among them)
    and the TokensPrompt key, read from the vLLM 0.23.0 wheel."""
    vllm = Sources.from_wheel(wheel("ASPC_VLLM_WHEEL", "vllm==0.23.0"), ("vllm",))
    engine = scripted_engine(["[3*4]"])
    engine.add(("s",), PROMPT, seed=5)
    used = set(vars(engine.llm.requests[0][1]))
    assert "stop_token_ids" in used and used <= dataclass_fields(vllm, "vllm.sampling_params", "SamplingParams")
    assert "prompt_token_ids" in dataclass_fields(vllm, "vllm.inputs.llm", "TokensPrompt")


# ---- `aspc run --backend ascend` on tiny_agentic ----
class RequestGenerator(BatchGenerator):
    """vLLM's per-request stops over the CPU generator: each request ends at the end of sequence,
    one of its stop_token_ids (kept as its last token), its max_tokens or max_model_len."""

    def __init__(self, model, slots, temperature, top_p, context):
        super().__init__(model, slots, max_tokens=context, temperature=temperature, top_p=top_p)
        self.context, self.limits = context, {}

    def request(self, key, ids, params):
        self.limits[key] = (params.max_tokens, set(params.stop_token_ids or ()))
        self.add(key, ids, params.seed)

    def _collect(self):
        done = []
        for slot, seq in list(self.active.items()):
            max_tokens, stops = self.limits[seq.key]
            last = seq.response[-1]
            if (last in self.eos_ids or last in stops or len(seq.response) >= max_tokens
                    or len(seq.prompt) + len(seq.response) >= self.context):
                del self.active[slot], self.limits[seq.key]
                done.append(Finished(seq.key, seq.prompt, seq.response, seq.logprobs, version=seq.version))
        return done


@dataclasses.dataclass
class StopParams(SamplingParams):
    stop_token_ids: list | None = None


class AgenticFakeLLM(FakeLLM):
    """FakeLLM whose requests carry their own stops and budgets (a turn of an episode)."""

    def _add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and params.logprobs == 0
        self.generator.request(request_id, prompt["prompt_token_ids"], params)


def agentic_platform(monkeypatch):
    """fake_platform, with each engine's vLLM an AgenticFakeLLM over the actor's weights."""
    from fake_comm import Hub, ThreadCommunicator

    built = fake_platform(monkeypatch)

    def engine_api(self, index, instances):
        if "cpu" not in self.__dict__:
            self.cpu, self.hubs = CpuExecutors(self.plan, self.base_dir, self.seed), {}
            built.append(self)
        options = dict(self.gen_stage.options)
        slots = default_slots(self.data.samples_per_step, instances, self.data.group, options.get("max_num_seqs"))
        generator = RequestGenerator(copy.deepcopy(self.cpu.actor).eval(), slots, options["temperature"],
                                     options["top_p"], self.gen_launch["config"]["max_model_len"])
        comm = ThreadCommunicator(1, self.hubs.setdefault(index, Hub()))
        return SimpleNamespace(LLM=lambda **args: AgenticFakeLLM(generator, comm, **args), SamplingParams=StopParams)

    monkeypatch.setattr(AscendExecutors, "engine_api", engine_api)
    return built


def separate_agentic(tmp_path):
    """tiny_agentic with one generation instance on a pool of its own (its tool module beside it)."""
    text = AGENTIC.read_text().replace("pool cpu = cpu x 2", "pool cpu = cpu x 1\npool rollout = cpu x 1")
    text = text.replace("generate(actor, prompts) on cpu { instances = 2", "generate(actor, prompts) on rollout "
                        "{ instances = 1")
    shutil.copy(ROOT / "pipelines" / "tiny_tools.py", tmp_path / "tiny_tools.py")
    path = tmp_path / "tiny_agentic_separate.aspl"
    path.write_text(text)
    return path


def recorded(monkeypatch, cls, name, log):
    original = getattr(cls, name)

    def record(self, *args):
        out = original(self, *args)
        log.append(out)
        return out

    monkeypatch.setattr(cls, name, record)


def agentic_run(aspc, tmp_path, monkeypatch, backend):
    calls, finished = [], []
    engine = EpisodeEngine if backend == "ascend" else EpisodeGenerator
    recorded(monkeypatch, engine, "pop_calls", calls)
    recorded(monkeypatch, engine, "_finish", finished)
    path = tmp_path / f"{backend}.jsonl"
    run = aspc("run", str(separate_agentic(tmp_path)), "--backend", backend, "--steps", "2", "--warmstart", "0",
               "--workers", "threads", "--metrics", str(path), "--set", "schedule.staleness=0")
    assert run.exit_code == 0, run.output
    metrics = [json.loads(line) for line in path.read_text().splitlines() if '"trained"' in line]
    # the held-out accuracy at the end of `aspc run` runs episodes too: their keys are plain prompt indices
    trained = {f.key: f for f in finished if isinstance(f.key, tuple)}
    return metrics, [c for batch in calls for c in batch if isinstance(c.key, tuple)], trained


def first_turn(sample):
    """The model's first turn: up to its first tool token, or the whole response."""
    return sample.response[:sample.mask.index(0)] if 0 in sample.mask else sample.response


def test_aspc_run_backend_ascend_runs_tool_calling_episodes_as_the_cpu_backend(aspc, tmp_path, monkeypatch):
    """The same controller and tool runners: the same samples trained per step; every episode's first
    turn (same weights, same seed) is the CPU run's, so are the calls made in first turns. Later turns
    are new vLLM requests with seeds of their own (episodes.turn_seed), so what follows a first
    observation, and the counts that depend on it, may differ. Tool tokens carry mask 0."""
    built = agentic_platform(monkeypatch)
    npu, npu_calls, npu_done = agentic_run(aspc, tmp_path, monkeypatch, "ascend")
    monkeypatch.undo()
    cpu, cpu_calls, cpu_done = agentic_run(aspc, tmp_path, monkeypatch, "cpu")
    assert len(npu) == len(cpu) == 2
    assert [m["trained"] for m in npu] == [m["trained"] for m in cpu]
    step1 = sorted(k for k in cpu_done if k[0] == 0)
    assert step1 == sorted(k for k in npu_done if k[0] == 0) and len(step1) == 64
    assert all(first_turn(npu_done[k]) == first_turn(cpu_done[k]) for k in step1)
    first_calls = [sorted((c.key, c.call) for c in calls if c.key[0] == 0 and c.turns == 1)
                   for calls in (npu_calls, cpu_calls)]
    assert first_calls[0] == first_calls[1]
    observed = 0
    for sample in npu_done.values():
        assert len(sample.mask) == len(sample.response) == len(sample.logprobs)
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.mask) if m == 0)
        runs = [decode(t for t, _ in run) for tool, run in
                itertools.groupby(zip(sample.response, sample.mask), key=lambda tm: tm[1] == 0) if tool]
        assert all(text.startswith("(") and text.endswith(")") for text in runs), runs  # observations only
        observed += bool(runs)
    assert observed and npu_calls  # observations were appended and tools were called
    [executors] = built
    assert executors.host._tools is None and not any(e.held or e.busy for e in executors.engines.values())


def test_the_megatron_trainer_packs_tool_tokens_out_of_every_loss_term():
    """An episode's tool results are attended to but in no loss term, as on the CPU learner."""
    from aspc.backends.ascend.packing import pack
    from aspc.rl.rollout import Rollout

    episode = Rollout(prompt=[1, 2, 3], response=[4, 5, 6, 7, 8], behaviour_logprobs=[-0.1] * 5, prompt_text="",
                      answer=None, key=(0, 0, 0), loss_mask=[1, 0, 0, 1, 1])
    plain = dataclasses.replace(episode, key=(0, 0, 1), loss_mask=None)
    [batch] = pack([episode, plain], tokens=32, advantages={(0, 0, 0): 1.0, (0, 0, 1): 1.0})
    counted = batch.loss_mask[0].tolist()
    first, second = batch.spans
    assert counted[first[0]:first[1]] == [1, 0, 0, 1, 1]  # response token i is predicted at prompt end + i
    assert counted[second[0]:second[1]] == [1] * 5
    assert sum(counted) == 8


def test_an_aborted_turn_keeps_its_tokens_and_goes_on_with_the_same_turn():
    """A partial rollout's carry-over inside an episode: the turn in flight stops after "[3*" (vLLM
    reported those tokens, unfinished); resubmitted, the same turn goes on from the whole history,
    with what is left of the budget and a seed of its own, and its call is the whole turn's."""
    from aspc.backends.vllm.engine import resumed_seed

    engine = scripted_engine(["[3*", "4]"])
    llm = engine.llm
    engine.add(("s",), PROMPT, seed=5)
    [(request_id, ids, tokens)] = llm.pending
    unfinished = SimpleNamespace(request_id=request_id, prompt_token_ids=ids, finished=False, outputs=[
        SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-0.25)} for t in tokens],
                        finish_reason=None)])
    aborted: list = []
    llm.llm_engine.step, llm.llm_engine.abort_request = (lambda: [unfinished]), aborted.extend
    assert engine.step() == [] and engine.busy
    state = engine.abort(("s",))
    assert aborted == [request_id] and not engine.busy and not engine.progress
    assert state.response == encode("[3*") and state.mask == [1, 1, 1] and state.logprobs == [-0.25] * 3
    assert state.aborts == 1

    llm.llm_engine.step, llm.pending = llm._step, []
    engine.resubmit(state)
    ids, params = llm.requests[1]
    assert ids == PROMPT + encode("[3*") and params.max_tokens == 20 - 3 and params.seed == resumed_seed(5, 1) != 5
    assert engine.step() == []
    [call] = engine.pop_calls()
    assert (call.call.tool, call.call.arguments, call.turns, call.generated) == ("calc", "3*4", 1, 5)
