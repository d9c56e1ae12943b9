"""The front end: lexing, parsing, resolving and checking an ASPL program, and lowering it to the IR."""
