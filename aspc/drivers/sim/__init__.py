"""The simulator driver: runs the controller on simulated instances in virtual time."""
