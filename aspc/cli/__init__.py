"""The command line: aspc check, compile, simulate, run, inspect."""
