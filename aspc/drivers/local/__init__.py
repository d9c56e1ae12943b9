"""The local driver: runs the controller with threads on this machine."""
