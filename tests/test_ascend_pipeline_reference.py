"""The reference model's log-probs with pipeline parallelism (backends/ascend/forward_only.py), on
CPU: two pipeline stages of a tiny decoder, each a thread running megatron's forward-only schedule
(fake_pipeline.py), hidden states handed from stage to stage over the in-process communicator;
the last stage's log-probs reach the first stage (rank 0, the leader) and equal the one-stage run."""
from types import SimpleNamespace

import pytest
import torch

from aspc.backends.ascend.forward_only import PipelinedForward, pipeline_group
from aspc.backends.ascend.packing import pack
from aspc.backends.cpu.model import TinyQwen
from aspc.ir.facts import ModelArch
from fake_comm import Hub, ThreadCommunicator, run_ranks
from fake_pipeline import pipeline_schedule, stages_of
from test_ascend_executors import one_rank  # noqa: F401 (a fixture)

ARCH = ModelArch(layers=4, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=32, vocab=32, max_seq=64)
TOKENS = 16


def rollouts() -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for key, (n_prompt, n_response) in enumerate([(5, 7), (9, 3), (4, 11), (6, 6), (8, 2)]):
        prompt, response = (torch.randint(1, ARCH.vocab, (n,), generator=generator).tolist()
                            for n in (n_prompt, n_response))
        out.append(SimpleNamespace(key=key, prompt=prompt, response=response, ref_logprobs=None,
                                   behaviour_logprobs=[0.0] * n_response))
    return out


def logprobs_on_rank(whole: TinyQwen, pp: int, comm) -> dict:
    group = list(range(pp))
    forward = PipelinedForward(TOKENS, comm, group, pipeline_schedule(comm, group, ARCH.hidden))
    return forward.logprobs(stages_of(whole, pp)[comm.rank], rollouts())


def test_two_pipeline_stages_deliver_the_one_stage_log_probs_to_every_stage(one_rank):  # noqa: F811
    """Stage 0 embeds and runs layers 0-1, stage 1 layers 2-3 and the output layer; megatron's
    vocab-parallel log-probs are computed on stage 1 only and broadcast over the pipeline group."""
    whole = TinyQwen(ARCH, seed=0).eval()
    assert len(pack(rollouts(), TOKENS)) > 1  # several micro-batches through the pipeline
    single = logprobs_on_rank(whole, 1, ThreadCommunicator(0, Hub()))
    first, last = run_ranks(2, lambda comm: logprobs_on_rank(whole, 2, comm))
    assert sorted(first) == sorted(single) == [r.key for r in rollouts()]
    for key, values in single.items():
        assert first[key] == pytest.approx(values, abs=1e-5) and last[key] == pytest.approx(values, abs=1e-5)
    r = rollouts()[2]  # the one-stage run is the whole model's log p(response token)
    ids = torch.tensor([r.prompt + r.response])
    mask = torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool))[None, None]
    with torch.no_grad():
        logp = whole(ids, torch.arange(ids.shape[1])[None], mask).log_softmax(-1)
    expected = logp[0, len(r.prompt) - 1:-1].gather(-1, torch.tensor(r.response)[:, None])[:, 0]
    assert single[r.key] == pytest.approx(expected.tolist(), abs=1e-5)


def test_a_rank_finds_its_pipeline_group_in_the_launch_stage():
    stage = {"groups": {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]]}}
    assert pipeline_group(stage, 3) == [1, 3] and pipeline_group({"groups": {}}, 5) == [5]
