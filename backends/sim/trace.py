"""The simulator's trace export: see aspc.trace."""
from aspc.trace import coalesce, trace_events, write_trace  # noqa: F401
