"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

    params.py     StructuredOutputsParams (vLLM's name): what a request asks for; shape checks only
    grammar.py    spec -> llguidance grammar; GrammarCompiler: validation, compile cache, thread pool
    matchers.py   StructuredState: one matcher per constrained sequence, the step's token bitmask

Floor 1 (with planner/): stdlib, numpy and llguidance only, never jax. The device side (the bitmask
applied inside the jitted sampler) is device/sampler.py's `token_bitmask` argument.
"""

from jaxpaged.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
