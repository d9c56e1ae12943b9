"""The Ray driver: runs the controller's executors as Ray actors."""
