"""Agentic RL on the CPU backend: multi-turn episodes with a calculator tool (backends/cpu/episodes.py,
agentic.py), their policy (aspc/controller/episodes.py), tool-call formats and the loss mask."""
import copy

import torch

from aspc.backends.cpu.agentic import demonstration, is_masked
from aspc.rl.host import final_answer
from aspc.rl.data import Prompt
from aspc.backends.cpu.learner import Learner
from aspc.rl.rollout import Rollout, TrainSettings
from aspc.backends.cpu.model import TinyQwen
from aspc.rl.tokenizer import BOS, EOS, encode
from aspc.rl.tool_calls import parse_compact, parse_hermes
from aspc.controller import episodes as ep
from aspc.ir.facts import ModelArch
from conftest import ROOT, verified_accuracy_over_a_run

PIPELINE = ROOT / "pipelines" / "tiny_agentic.aspl"
ARCH = ModelArch(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=256, vocab=32, max_seq=64)


def test_calls_are_parsed_by_their_format():
    assert parse_compact("[417*63]", "calc").arguments == "417*63"
    assert parse_compact("12]", "calc") is None and parse_compact("[]", "calc") is None
    call = parse_hermes('<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>', {"calc"})
    assert call.tool == "calc" and '"expression": "2*3"' in call.arguments
    assert parse_hermes('<tool_call>{"name": "shell", "arguments": {}}</tool_call>', {"calc"}) is None
    assert parse_hermes("<tool_call>{not json</tool_call>", {"calc"}) is None


def test_the_episode_policy_ends_episodes_for_their_reasons():
    policy = ep.EpisodePolicy(max_turns=3, max_invalid=2)
    episode = ep.Episode()
    assert episode.after_turn(policy, ep.CALL) is None and episode.tool_calls == 1
    assert episode.after_turn(policy, ep.EOS) == ep.ANSWER
    invalid = ep.Episode()
    assert invalid.after_turn(policy, ep.BAD_CALL) is None
    assert invalid.after_turn(policy, ep.BAD_CALL) == ep.INVALID  # an invalid-call loop ends
    long = ep.Episode()
    assert [long.after_turn(policy, ep.CALL) for _ in range(3)] == [None, None, ep.MAX_TURNS]
    assert ep.Episode().after_turn(policy, ep.OUT_OF_BUDGET) == ep.BUDGET
    crashed, slow, raised = ep.Episode(), ep.Episode(), ep.Episode()
    assert crashed.tool_failed("crashed") == ep.TOOL_CRASHED and is_masked({"ended": crashed.ended})
    assert slow.tool_failed("timeout") == ep.TOOL_TIMEOUT and not is_masked({"ended": slow.ended})
    assert raised.tool_failed("error") is None  # an error is an observation the model reads


def test_a_demonstration_masks_the_tool_tokens_and_the_answer_follows_them():
    response, mask = demonstration(Prompt("417*63=", [BOS] + encode("417*63="), "26271"))
    assert response == encode("[417*63](26271)26271") + [EOS]
    assert [m for m, t in zip(mask, response) if t in encode("(26271)")[:1]] == [0]
    assert final_answer(response, mask) == "26271"
    assert final_answer(encode("42") + [EOS], [1, 1, 1]) == "42"


def _settings():
    return TrainSettings(loss="grpo", lr=1e-3, kl=0.1, clip=0.2, clip_high=0.2, value_coef=0.5, entropy_coef=0.01,
                         micro_tokens=1024, weight_decay=0.0, grad_clip=0.0, overlong=0, max_tokens=24,
                         estimator="grpo", gamma=1.0, lam=1.0, normalize=True, group=2)


def _gradients(tool_logprob: float, tool_ref: float) -> list[torch.Tensor]:
    """The policy gradient of two episodes whose tool tokens' behaviour and reference log-probs are set."""
    actor = TinyQwen(ARCH, seed=0)
    learner = Learner(actor, copy.deepcopy(actor), None, _settings(), None)
    rollouts = []
    for reward, answer in ((1.0, "26271"), (0.0, "26270")):
        response, mask = demonstration(Prompt("417*63=", [], answer))
        logprobs = [-1.0 if m else tool_logprob for m in mask]
        r = Rollout([BOS] + encode("417*63="), response, logprobs, "417*63=", "26271", loss_mask=mask,
                    reward=reward)
        r.ref_logprobs = [-1.2 if m else tool_ref for m in mask]
        rollouts.append(r)
    learner.train(rollouts)
    return [p.grad.clone() for p in actor.parameters() if p.grad is not None]


def test_tool_tokens_carry_no_gradient():
    """Changing the tool tokens' old and reference log-probs changes no loss term: they are read
    (attended to) but never trained on."""
    base, changed = _gradients(-0.5, -0.5), _gradients(-9.0, -3.0)
    assert base and all(torch.equal(a, b) for a, b in zip(base, changed))


def test_an_unimportable_tool_module_is_a_located_error(aspc, tmp_path):
    text = PIPELINE.read_text().replace("tiny_tools:calc", "no_such_tools:calc")
    (tmp_path / "p.aspl").write_text(text)
    result = aspc("check", str(tmp_path / "p.aspl"))
    assert result.exit_code == 1 and "p.aspl:" in result.output and "no_such_tools" in result.output


def test_the_cpu_backend_refuses_hermes_calls(aspc, tmp_path):
    (tmp_path / "tiny_tools.py").write_text((ROOT / "pipelines" / "tiny_tools.py").read_text())
    (tmp_path / "p.aspl").write_text(PIPELINE.read_text().replace("format = compact", "format = hermes"))
    result = aspc("run", str(tmp_path / "p.aspl"), "--steps", "1")
    assert result.exit_code == 1 and "compact tool calls only" in result.output and "Traceback" not in result.output


def test_agentic_rl_raises_accuracy_with_tools_and_makes_the_calls_right(monkeypatch):
    """The acceptance test: after a warm start that shows the call format, RL raises the greedy
    held-out accuracy (verified final answers) and the fraction of calls that get the right number.
    The pipeline is named as the README names it, relative to the repository root (its tool module
    is found beside it although the sandbox runs each call in a scratch folder)."""
    monkeypatch.chdir(ROOT)
    relative = PIPELINE.relative_to(ROOT)
    before, after, result, runtime = verified_accuracy_over_a_run(relative, steps=40, warmstart=800)
    calls_after = runtime.executors.evaluate_episodes(256)
    assert after > before + 0.1, f"greedy verified accuracy with tools {before:.3f} -> {after:.3f}"
    assert calls_after["right_calls"] > 0.9 and calls_after["called"] > 0.95
    assert all(m["ended"].get("answer", 0) > 0 and m["tool_calls"] > 0 for m in result.metrics)
    assert result.metrics[-1]["tool_calls"] >= result.metrics[0]["tool_calls"]


FLAKY_TOOLS = '''
import os
import time


def calc(expression):
    if "9" in expression:
        time.sleep(30)  # runs past its timeout (0.5 s in this test): the episode ends, tool_timeout
    if "7" in expression:
        os._exit(3)  # the tool's worker dies mid-call: an infrastructure failure
    if "3" in expression:
        raise ValueError("no")  # an error observation
    if "5" in expression:
        return "\\udcff garbage \\x00 " * 1000  # unreadable, long
    return "12"
'''


def test_tools_that_time_out_crash_raise_or_print_garbage_lose_no_sample(tmp_path):
    from aspc.accounting.measured import bubble_shares
    from aspc.backends.cpu.executors import CpuExecutors
    from aspc.drivers.local.runtime import LocalRuntime, RunOptions
    from aspc.cli.toolchain import compile_with_passes

    (tmp_path / "tiny_tools.py").write_text(FLAKY_TOOLS)
    (tmp_path / "p.aspl").write_text(PIPELINE.read_text().replace("timeout = 5", "timeout = 0.5"))
    plan = compile_with_passes(tmp_path / "p.aspl", []).plan()
    runtime = LocalRuntime(plan, tmp_path, RunOptions(steps=2, warmstart_steps=100, seed=0), CpuExecutors)
    runtime.build()
    result = runtime.run()
    ended = {}
    for m in result.metrics:
        assert len(m["trained"]) == m["samples"] == 64  # every episode trained, whatever its tool did
        for reason, count in m["ended"].items():
            ended[reason] = ended.get(reason, 0) + count
    assert ended.get("tool_crashed", 0) > 0 and ended.get("tool_timeout", 0) > 0 and ended.get("answer", 0) > 0
    crashed = [r for r in runtime.rollouts.values() if r.episode and r.episode["ended"] == "tool_crashed"]
    assert crashed and all(r.masked for r in crashed)
    error = encode("(#)")
    assert any(_contains(r.response, error) and r.episode["ended"] == "answer"
               for r in runtime.rollouts.values())  # an error observation, and the episode went on to answer
    timed_out = [r for r in runtime.rollouts.values() if r.episode and r.episode["ended"] == "tool_timeout"]
    assert timed_out and not any(r.masked for r in timed_out)  # the model's call: scored, not masked
    calls = [s for s in result.spans if s.category == "tool"]  # the tool runners: a resource in the trace
    assert calls and {s.track for s in calls} <= {f"tools[{k}]" for k in range(4)}  # tool_workers = 4
    for track in {s.track for s in calls}:  # one call at a time per runner
        own = sorted((s.start, s.end) for s in calls if s.track == track)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(own, own[1:]))
    assert bubble_shares(result.spans, result.wall_s)["tool_wait"] > 0  # instances idle on 0.5 s timeouts


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens)))


def _scripted_generator(script: str, max_invalid: int = 2, max_turns: int = 4, end: bool = False):
    """An episode generator over the tiny model whose sampled tokens are replaced by `script`
    (repeated; `end`: then end of sequence): the model's choices are fixed, the rest is real."""
    from aspc.backends.cpu.episodes import Environment, EpisodeGenerator

    env = Environment(ep.EpisodePolicy(max_turns, max_invalid), "calc", 16)
    generator = EpisodeGenerator(TinyQwen(ARCH, seed=0).eval(), 4, 24, 1.0, 1.0, False, env)
    tokens = encode(script) + ([EOS] if end else [])
    sample = generator._sample

    def scripted(seq, logits):
        sample(seq, logits)
        written = sum(seq.mask) - 1  # the model tokens before this one
        seq.response[-1] = tokens[written % len(tokens)]
        generator.logits[written] = logits.clone()

    generator._sample = scripted
    generator.logits = {}
    return generator


class _Result:
    def __init__(self, status: str, observation: str = ""):
        self.status, self.observation = status, observation


def _episodes(generator, tool=lambda call: _Result("ok", "6")) -> list:
    done = []
    while generator.busy or generator.held:
        done += generator.step() if generator.busy else []
        for c in generator.pop_calls():
            done += generator.resume(c.key, tool(c.call))
    return done


def test_an_invalid_call_loop_ends_the_episode_and_keeps_the_sample():
    generator = _scripted_generator("2]")  # a close without an open: malformed, again and again
    generator.add("a", [BOS] + encode("2*3="), seed=0)
    [finished] = _episodes(generator)
    assert finished.episode["ended"] == ep.INVALID and finished.episode["turns"] == 2
    error = encode("(#)")  # the first invalid call got the error observation, masked from the loss
    at = next(i for i in range(len(finished.response)) if finished.response[i:i + 3] == error)
    assert finished.mask[at:at + 3] == [0, 0, 0] and sum(finished.mask) == 4


def test_a_moved_episode_goes_on_from_the_same_tokens():
    """detach on one instance, adopt on another: the history's token ids are prefilled there (not
    re-encoded), the tool's result appended, and the episode ends as it would have at home."""
    home, away = _scripted_generator("[2*3]6", end=True), _scripted_generator("[2*3]6", end=True)
    stay = _scripted_generator("[2*3]6", end=True)  # the same episode, resumed where it is
    for generator in (home, stay):
        generator.add("a", [BOS] + encode("2*3="), seed=0)
        while not generator.held:
            generator.step()
    stayed = _episodes(stay, tool=lambda call: _Result("ok", "6"))
    [call] = home.pop_calls()
    assert call.call.arguments == "2*3" and call.context == len(encode("2*3=")) + 1 + len(encode("[2*3]"))
    moved = home.detach("a")
    assert not home.held and not home.busy
    done = away.adopt(moved, _Result("ok", "6"))
    while away.busy:
        done += away.step()
    [finished] = done
    assert finished.response == encode("[2*3](6)6") + [EOS] and finished.episode["ended"] == ep.ANSWER
    assert finished.mask == [1] * 5 + [0] * 3 + [1, 1]
    assert final_answer(finished.response, finished.mask) == "6"
    assert finished.response == stayed[0].response
    for written in (5, 6):  # the turn after the observation sees the same history through its KV cache
        assert torch.allclose(away.logits[written], stay.logits[written], atol=1e-5)
