"""The RL semantics, written once, outside any engine: losses and their aggregation, advantages,
off-policy corrections, reward functions and their shaping, prompt data and tasks, tokenizers and
chat templates, tool-call formats and the judge's prompt. Pure torch and Python: no engine, no
device, no driver. Every engine (backends/cpu, backends/ascend) computes log-probs, values and
logits and hands them to these functions; none carries its own loss (verl's core_algos beside its
engines, AReaL's api/ and reward/ beside engine/)."""
