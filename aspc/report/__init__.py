"""`aspc report`: one self-contained HTML page of a pipeline's compiled schedules, their simulated
timelines and bubbles, the passes' decisions at their source lines, and optionally a measured run.

The page renders what the CLI hands it (aspc/report/model.py): it imports the IR and the accounting
only, never the front end, passes, plan, controller or drivers (a contract in pyproject.toml).
"""
