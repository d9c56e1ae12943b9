"""Reward functions the tiny pipelines name in python(...) sources: (prompt, response, answer,
metadata) -> float. None of them reads the answer: that is the verifier's, which only measures."""


def well_formed(prompt: str, response: str, answer, metadata) -> float:
    """1.0 for an answer written as a number (digits only, no leading zero), else 0.0."""
    return float(response.isdigit() and (response == "0" or not response.startswith("0")))
