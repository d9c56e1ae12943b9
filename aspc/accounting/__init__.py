"""Accounting of time: bubbles, the simulated ledger, measured accounting and traces."""
