"""jaxpaged: vLLM's PagedAttention serving design in JAX and Pallas.

    from jaxpaged import LLM, SamplingParams

The host side (sequence, block manager, scheduler, sampling params) never imports jax, so
`LLM` and the engine are imported lazily: `import jaxpaged.planner.scheduler` stays light.
"""

from jaxpaged.engine.beam_search import BeamOutput, BeamSearchOutput, BeamSearchParams
from jaxpaged.engine.outputs import CompletionOutput, RequestOutput
from jaxpaged.planner.lora_request import LoRARequest
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.structured_params import StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput",
    "BeamSearchParams", "BeamSearchOutput", "BeamOutput", "LoRARequest",
]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from jaxpaged.entrypoints.llm import LLM

        return LLM
    if name == "EngineConfig":
        from jaxpaged.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
