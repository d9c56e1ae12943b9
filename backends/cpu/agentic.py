"""The CPU backend's agentic RL: an environment stage's episodes on the CPU generator.

One run holds one `ToolRunner` (aspc/rl/tool_runner.py: bounded processes, timeouts, resource
limits), shared by every generation instance (the host's `Tools`, aspc/rl/host.py). In a run, which
call runs when and on which of the `tool_workers` runners is the controller's
(aspc/controller/tools.py): the driver calls `run` from one thread per runner. Held-out evaluation
runs its episodes' calls on a pool of as many threads. The warm start demonstrates the compact
call format on one example in DEMO_EVERY: the prompt's expression as the call, the answer as
the observation and as the final answer (it shows the format; it does not run the tool)."""
from __future__ import annotations

import concurrent.futures as futures
import copy

from aspc.backends.cpu.episodes import Environment, EpisodeGenerator
from aspc.controller.episodes import MASKED, EpisodePolicy
from aspc.rl.data import HELD_OUT
from aspc.rl.host import Tools, final_answer
from aspc.rl.tokenizer import EOS, decode, encode
from aspc.rl.tool_calls import compact_observation

DEMO_EVERY = 2  # warm-start examples per one that shows a tool call (1 in 4 or 8 taught too little copying)


def environment(stage) -> Environment:
    """The environment stage as the CPU episode generator reads it: the shared policy, the compact
    format's one tool, the cap on an observation's tokens."""
    options = dict(stage.options)
    return Environment(EpisodePolicy.of(stage), options["tools"][0].get("name"), options["max_tool_tokens"])


def episode_generator(model, slots: int, gen_options: dict, static: bool, env: Environment,
                      record_routes: bool = False) -> EpisodeGenerator:
    return EpisodeGenerator(model, slots, gen_options["max_tokens"], gen_options["temperature"],
                            gen_options["top_p"], static, env, record_routes)


def is_masked(episode: dict) -> bool:
    """An episode ended by an infrastructure failure (a crashed tool worker), not by the model."""
    return episode["ended"] in MASKED


def demonstration(prompt) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of a compact call of the prompt's expression: `[A*B](C)C`."""
    call = encode("[" + prompt.text.rstrip("=") + "]")
    observation = encode(compact_observation("ok", prompt.answer))
    answer = encode(prompt.answer) + [EOS]
    return call + observation + answer, [1] * len(call) + [0] * len(observation) + [1] * len(answer)


def run_episodes(generator: EpisodeGenerator, tools: Tools):
    """Drive a generator's episodes to their ends outside a run, each call on the tools' threads;
    yields what finishes."""
    pending: dict = {}
    while generator.busy or generator.held:
        finished = generator.step() if generator.busy else []
        pending.update({c.key: tools.threads.submit(tools.run, c.call) for c in generator.pop_calls()})
        if not generator.busy and pending:
            futures.wait(pending.values(), return_when=futures.FIRST_COMPLETED)
        for key in [k for k, f in pending.items() if f.done()]:
            finished += generator.resume(key, pending.pop(key).result())
            pending.update({c.key: tools.threads.submit(tools.run, c.call) for c in generator.pop_calls()})
        yield from finished


def evaluate_episodes(model, prompts, tools: Tools, env: Environment, reward_fn, count: int,
                      max_tokens: int) -> dict:
    """Greedy episodes on held-out prompts: the verified accuracy of the final answers, the
    fraction that made a valid tool call, and the fraction whose call got the right number."""
    generator = EpisodeGenerator(copy.deepcopy(model).eval(), 64, max_tokens, 0.0, 1.0, False, env)
    count = prompts.held_out_count(count)  # a JSONL file's held-out rows may be fewer
    items = {i: prompts(HELD_OUT + i) for i in range(count)}
    for i, p in items.items():
        generator.add(i, p.ids, seed=i)
    right = called = right_calls = 0.0
    for f in run_episodes(generator, tools):
        p = items[f.key]
        right += reward_fn(p.text, final_answer(f.response, f.mask), p.answer, p.metadata)
        called += f.episode["tool_calls"] > 0
        right_calls += compact_observation("ok", p.answer or "") in decode(f.response)
    return {"accuracy": right / count, "called": called / count, "right_calls": right_calls / count}
