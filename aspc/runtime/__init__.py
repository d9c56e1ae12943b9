"""Drivers that run the controller on real executors: `local` (threads, the CPU backend)."""
