"""The CPU backend's agentic RL: an environment stage's tools, runners and episodes.

One run holds one `ToolRunner` (tool_runner.py: bounded processes, timeouts, resource limits),
shared by every generation instance. In a run, which call runs when and on which of the
`tool_workers` runners is the controller's (aspc/controller/tools.py): the driver calls `run`
from one thread per runner. Held-out evaluation runs its episodes' calls on a pool of as many
threads. The warm start demonstrates the compact
call format on one example in DEMO_EVERY: the prompt's expression as the call, the answer as
the observation and as the final answer (it shows the format; it does not run the tool)."""
from __future__ import annotations

import concurrent.futures as futures
import copy
from pathlib import Path

from aspc.backends.cpu.episodes import Environment, EpisodeGenerator
from aspc.rl.tokenizer import EOS, decode, encode
from aspc.rl.tool_calls import compact_observation
from aspc.controller.episodes import MASKED, EpisodePolicy

DEMO_EVERY = 2  # warm-start examples per one that shows a tool call (1 in 4 or 8 taught too little copying)


class Tools:
    """The environment's tools, run for the generation instances."""

    def __init__(self, stage, base_dir: Path | None):
        from aspc.backends.cpu.tool_runner import ToolRunner, ToolSpec

        options = dict(stage.options)
        # absolute: the sandbox changes into a scratch folder before it looks the tool's module up
        folder = str(Path(base_dir).resolve()) if base_dir is not None else None
        specs = [ToolSpec(t.get("name"), t.get("python"), t.get("command"), t.get("timeout"), t.get("env"), folder)
                 for t in options["tools"]]
        self.runner = ToolRunner(specs, workers=options["tool_workers"])
        self.threads = futures.ThreadPoolExecutor(options["tool_workers"], thread_name_prefix="tool")
        self.environment = Environment(EpisodePolicy.of(stage), specs[0].name, options["max_tool_tokens"])

    def run(self, call):
        """Run one call to its end (a ToolResult: status "ok", "error", "timeout" or "crashed")."""
        return self.runner.run(call.tool, call.arguments)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.runner.close()


def episode_generator(model, slots: int, gen_options: dict, static: bool, tools: Tools) -> EpisodeGenerator:
    return EpisodeGenerator(model, slots, gen_options["max_tokens"], gen_options["temperature"],
                            gen_options["top_p"], static, tools.environment)


def final_answer(response: list[int], mask: list[int]) -> str:
    """The text of the last model turn, after the last tool observation: what the reward reads."""
    tool_positions = [i for i, m in enumerate(mask) if m == 0]
    start = tool_positions[-1] + 1 if tool_positions else 0
    return decode(response[start:])


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


def evaluate_episodes(model, prompts, tools: Tools, reward_fn, count: int, max_tokens: int) -> dict:
    """Greedy episodes on held-out prompts: the verified accuracy of the final answers, the
    fraction that made a valid tool call, and the fraction whose call got the right number."""
    from aspc.backends.cpu.evaluate import HELD_OUT

    generator = EpisodeGenerator(copy.deepcopy(model).eval(), 64, max_tokens, 0.0, 1.0, False, tools.environment)
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
