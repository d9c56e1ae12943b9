"""aspc: a compiler and runtime for RL post-training pipelines (the Adaptive Scheduling Pipeline)."""

__version__ = "0.1.0"
