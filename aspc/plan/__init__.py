"""The execution plan the compiler emits (the toolchain that produces it from a program: aspc/cli/toolchain.py)."""
