"""Speculative decoding: a drafter proposes, one target forward verifies, the engine keeps what the target agrees with.

    checks.py   start-up: the drafter exists and can run with this model and these plugins
    verify.py   greedy acceptance and rejection sampling over a request's verify rows
    step.py     one engine step with drafts: draft, forward, verify, append, release rejected KV
"""
