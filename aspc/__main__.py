"""`python -m aspc ...`: the same command line as `aspc ...`."""
from aspc.cli.main import entry

entry()
