"""From a model name and engine arguments to a running engine: the one place that decides.

    EngineConfig ─► devices checked ─► model loaded ─► config resolved for the platform
                ─► attention backend ─► KV pool size ─► LLMEngine, or data_parallel_size of them
"""

from __future__ import annotations

from jaxpaged.config import EngineConfig
from jaxpaged.device.backends import attention_fn as backend_attention_fn
from jaxpaged.device.kv_cache import num_pages_for, on_gpu
from jaxpaged.device.sharding import replica_meshes
from jaxpaged.engine.data_parallel import DataParallelEngine
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.engine.protocol import EngineClient
from jaxpaged.models.weights import load_model


def build_engine(model: str | None, config: EngineConfig) -> EngineClient:
    """Loads `model` (None: the bundled SmolLM2) and builds the engine `config` describes."""
    # Before loading: too few devices is an error the user should see at once.
    replica_meshes(config.data_parallel_size, config.tensor_parallel_size)
    dtype = config.dtype or ("bfloat16" if on_gpu() else "float32")
    model_config, params, tokenizer = load_model(model, dtype=dtype)
    config = config.resolved(on_gpu=on_gpu(), model_max_len=model_config.max_position_embeddings)
    attention_fn = backend_attention_fn(config.attention_backend)
    num_pages = num_pages_for(config, model_config, params, attention_fn)
    draft_model = None
    spec = config.speculative_config
    if spec is not None and spec["method"] == "draft_model":  # the draft's pool is sized as the target's (DESIGN.md)
        draft_config, draft_params, _ = load_model(spec["model"], dtype=config.dtype)
        draft_model = (draft_config, draft_params)
    return engine_from_parts(model_config, params, tokenizer, config, num_pages=num_pages, attention_fn=attention_fn,
                             draft_model=draft_model)


def engine_from_parts(model_config, params, tokenizer, config: EngineConfig, *, num_pages: int,
                      attention_fn, draft_model=None) -> EngineClient:
    """One `LLMEngine`, or a `DataParallelEngine` of `config.data_parallel_size` of them, each on its
    own `tensor_parallel_size` devices (a model of your own, tests)."""
    meshes = replica_meshes(config.data_parallel_size, config.tensor_parallel_size)
    engines = [
        LLMEngine(model_config, params, tokenizer, config, num_pages=num_pages, attention_fn=attention_fn, mesh=mesh,
                  draft_model=draft_model)
        for mesh in meshes
    ]
    return engines[0] if len(engines) == 1 else DataParallelEngine(engines)
