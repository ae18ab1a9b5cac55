"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

    grammar.py    spec -> llguidance grammar; GrammarCompiler: validation, compile cache, thread pool
    matchers.py   StructuredState: one matcher per constrained sequence, the step's token bitmask

What a request asks for, `StructuredOutputsParams` (vLLM's name; shape checks only), is a request
parameter: it lives in planner/structured_params.py and is re-exported here. This package may import
the planner, never the other way.

Floor 1 (with planner/): stdlib, numpy and llguidance only, never jax. The device side (the bitmask
applied inside the jitted sampler) is sample/sampler.py's `token_bitmask` argument.
"""

from jaxpaged.planner.structured_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
