"""The IR: the stage graph and the facts, memory, values and checks the compiler reasons with."""
