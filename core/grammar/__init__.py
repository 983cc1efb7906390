"""Structured outputs in the engine: constraints compiled off the step loop (compiler), each constrained request's
matcher (book), and the token bitmask applied to the logits just before sampling (mask)."""
