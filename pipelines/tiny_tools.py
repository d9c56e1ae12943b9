"""Tools the tiny agentic pipeline names in tool(python = ...) sources: called with the argument
string the model wrote, they return what the model reads back."""


def calc(expression: str) -> str:
    """A calculator for "A*B", "A+B" or "A-B" with non-negative integers: the exact result."""
    for op, apply in (("*", lambda a, b: a * b), ("+", lambda a, b: a + b), ("-", lambda a, b: a - b)):
        left, found, right = expression.partition(op)
        if found:
            if not (left.isdigit() and right.isdigit()):
                raise ValueError(f"not a number: {expression!r}")
            return str(apply(int(left), int(right)))
    raise ValueError(f"no operator in {expression!r}")
