"""Cost models: the roofline model, its calibrated variant, workloads and the learner's step time."""
