"""Generation instances with dp > 1 (backends/ascend/engine_group.py): an instance is its dp vLLM
engine ranks, each started with its rank's launch environment; requests spread as vLLM's
data-parallel balancer spreads them, every rank polled, a MoE group's idle ranks given a placeholder
so that all ranks start each wave together, and sleep, wake and the streamed refresh on every rank.
The fakes are test_ascend_executors' and test_ascend_colocated's."""
import os
from types import SimpleNamespace

import torch

from aspc.backends.ascend import engine_args
from aspc.backends.ascend.engine_actor import VllmEngine
from aspc.backends.ascend.engine_group import PLACEHOLDER, EngineGroup, least_loaded_rank
from test_ascend_colocated import PlacedIpcLLM, Tagged, all_ranks_send, engine_calls, trainer_chips
from test_ascend_executors import (REFRESH, TINY, SamplingParams, fake_colocated_platform, npu_trains_as_cpu,
                                   tiny_variant)

DP_ENV = ("VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_DP_SIZE", "VLLM_DP_MASTER_IP", "VLLM_DP_MASTER_PORT",
          "ASCEND_RT_VISIBLE_DEVICES")


# ---- the group's mechanics, on fake ranks ----
class EchoLLM:
    """A rank's fake vLLM: a request finishes at its second step, with up to two tokens."""

    def __init__(self, **engine_args):
        self.added, self.steps, self.queued, self.running = [], 0, [], []
        self.llm_engine = SimpleNamespace(add_request=self._add, step=self._step)

    def _add(self, request_id, prompt, params):
        self.added.append((prompt["prompt_token_ids"], params.max_tokens))
        self.queued.append((request_id, prompt["prompt_token_ids"], params.max_tokens))

    def _step(self):
        self.steps += 1
        done, self.running, self.queued = self.running, self.queued, []
        return [SimpleNamespace(request_id=rid, prompt_token_ids=ids, finished=True, outputs=[SimpleNamespace(
            token_ids=[7] * min(n, 2), logprobs=[{7: SimpleNamespace(logprob=-1.0)}] * min(n, 2),
            finish_reason="length")]) for rid, ids, n in done]


def echo_group(lockstep=True, dp=2, slots=4):
    launch = {"config": {"max_num_seqs": slots}, "micro_batching": {
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}, "weight_refresh": None}}
    api = SimpleNamespace(LLM=EchoLLM, SamplingParams=SamplingParams)
    return EngineGroup([VllmEngine(launch, 0, api) for _ in range(dp)], 0, lockstep)


def drain(group, limit=20):
    finished = []
    while group.busy and limit:
        finished += group.step()
        limit -= 1
    return finished


def test_a_request_goes_to_the_rank_vllms_balancer_picks():
    """Lowest waiting * 4 + running, the first rank on a tie (vllm/v1/engine/core_client.py)."""
    assert least_loaded_rank([(0, 0), (0, 0)]) == 0
    assert least_loaded_rank([(0, 1), (0, 0)]) == 1
    assert least_loaded_rank([(1, 4), (0, 7)]) == 1  # 8 > 7
    assert least_loaded_rank([(0, 3), (1, 0), (0, 2)]) == 2


def test_every_request_is_answered_once_from_every_rank_and_an_idle_rank_gets_a_placeholder():
    group = echo_group()
    group.add("a", [1, 2, 3], 0)
    assert drain(group) and not group.busy
    rank0, rank1 = (engine.llm for engine in group.engines)
    assert rank0.added == [([1, 2, 3], 8)] and rank1.added == [([1], 1)]  # a one-token placeholder
    keys = [f.key for f in drain_after(group, "bcdefghij")]
    assert sorted(keys) == list("bcdefghij")  # the placeholder's output never reaches the controller
    assert len(rank0.added) == 1 + 5 and len(rank1.added) == 1 + 4  # spread, none left idle
    assert rank0.steps and rank1.steps and PLACEHOLDER not in keys


def drain_after(group, keys):
    for at, key in enumerate(keys):
        group.add(key, [at + 1], at)
    return drain(group)


def test_a_dense_groups_ranks_are_independent_engines_without_placeholders():
    group = echo_group(lockstep=False)
    assert [f.key for f in drain_after(group, "a")] == ["a"]
    assert group.engines[1]._llm is None  # never started: no work for it


# ---- an instance with dp = 2 through the controller (`aspc run --backend ascend`) ----
class RankIpcLLM(PlacedIpcLLM):
    """A colocated engine rank: its calls tagged "instance.rank", the launch environment it started with."""

    def __init__(self, log, instance, generator, **engine_args):
        super().__init__(log, instance, generator, **engine_args)
        self.started_with = {key: os.environ.get(key) for key in DP_ENV}
        self.calls = Tagged(log, f"{instance}.{os.environ['VLLM_DP_RANK']}")


def as_moe(monkeypatch):
    """The tiny model is dense (its ranks would be independent engines, without VLLM_DP_*): lower it as
    a MoE model's data-parallel group."""
    group_env = engine_args.data_parallel_env
    monkeypatch.setattr(engine_args, "data_parallel_env", lambda is_moe, *args: group_env(True, *args))


def one_dp_instance(tmp_path):
    """tiny_grpo with one generation instance of dp = 2 (NPU 0 and NPU 1), a trainer rank on each."""
    return tiny_variant(tmp_path, "tiny_grpo_dp", ("instances = 2,", "instances = 1, dp = 2,"),
                        ("loss = grpo, lr = 3e-4", "dp = 2, loss = grpo, lr = 3e-4"))


def test_an_instance_with_dp_2_runs_as_two_engine_ranks_through_the_controller(aspc, tmp_path, monkeypatch):
    """The same samples per step as `--backend cpu` (every request answered once); each rank starts
    with its rank's DP environment and NPU, generates, sleeps, wakes and loads every version from
    the trainer rank on its own NPU."""
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    as_moe(monkeypatch)
    built = fake_colocated_platform(monkeypatch, llm=RankIpcLLM,
                                    send=lambda self: all_ranks_send(trainer_chips(self)))
    npu_trains_as_cpu(aspc, one_dp_instance(tmp_path), tmp_path)
    [executors] = built
    group = executors.engines[0]
    published = executors.learner.sender.staged.get(1)
    for rank, engine in enumerate(group.engines):
        port = group.engines[0].llm.started_with["VLLM_DP_MASTER_PORT"]
        assert engine.llm.started_with == {"VLLM_DP_RANK": str(rank), "VLLM_DP_RANK_LOCAL": str(rank),
                                           "VLLM_DP_SIZE": "2", "VLLM_DP_MASTER_IP": "${NODE[0]}",
                                           "VLLM_DP_MASTER_PORT": port, "ASCEND_RT_VISIBLE_DEVICES": str(rank)}
        assert engine_calls(executors.log, f"0.{rank}") == ["sleep(1)", "init_weight_transfer_engine", *REFRESH,
                                                            "generate", "sleep(1)", *REFRESH, "generate",
                                                            "sleep(1)"], (rank, executors.log)
        assert engine.llm.read == {f"node0-{rank}"}
        loaded = engine.llm.generator.model.state_dict()
        assert engine.version == 1 and all(torch.equal(loaded[name], t) for name, t in published.items())
    assert "VLLM_DP_RANK" not in os.environ  # each rank's placement put back after it started



def test_what_an_instance_with_dp_above_1_does_not_run_is_refused_at_its_dp(tmp_path):
    """A pool of its own (the HCCL transfer group holds one engine's workers) and agentic episodes
    (one EpisodeEngine per instance) stay refused, at the stage's dp."""
    from aspc.backends.ascend.run_executors import AscendExecutors
    from aspc.cli.toolchain import compile_with_passes

    def refusals(name, *edits):
        text = (TINY.parent / f"{name}.aspl").read_text()
        for old, new in edits:
            assert old in text
            text = text.replace(old, new)
        path = tmp_path / f"{name}_dp.aspl"
        path.write_text(text)
        (tmp_path / "tiny_tools.py").write_text((TINY.parent / "tiny_tools.py").read_text())  # the agentic tools
        return [r for r in AscendExecutors.unsupported(compile_with_passes(path).plan(), "ray") if r.option == "dp"]

    [split] = refusals("tiny_grpo_split", ("pool rollout = cpu x 1", "pool rollout = cpu x 2"),
                       ("instances = 1,", "instances = 1, dp = 2,"))
    assert split.stage == "gen" and "pool of its own" in split.message and "dp = 1" in split.hint
    [agentic] = refusals("tiny_agentic", ("instances = 2,", "instances = 1, dp = 2,"))
    assert agentic.stage == "gen" and "agentic episodes" in agentic.message
