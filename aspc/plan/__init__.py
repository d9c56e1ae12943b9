"""The execution plan the compiler emits, and the toolchain that produces it from a program."""
