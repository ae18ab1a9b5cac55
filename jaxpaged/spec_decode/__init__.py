"""Speculative decoding: propose k tokens per sequence, verify them all in one target step.

    ngram.py      host: prompt-lookup proposals from a sequence's own tokens (no model, no jax)
    draft_model.py device: a smaller model's proposals, its K/V in a second buffer under the same block tables
    verifier.py   device: greedy longest-prefix acceptance and rejection sampling, one jitted call
    speculator.py host: proposals into the step, verification rows, rollback of rejected tokens, stats
"""
