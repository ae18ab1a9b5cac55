"""From a model name to what the engine runs: `(ModelConfig, params, Tokenizer)`.

    model name ──resolve──► files (GGUF / HF dir / hub snapshot)
                             │
        orbax cache hit? ────┤ yes: restore converted params (fast)
                             │ no:  read state dict (dequantize GGUF) ─► params_from_hf ─► save to cache
                             ▼
                    (ModelConfig, params, Tokenizer)

Loaded models are memoized per process, so building several `LLM`s over one model (tests,
benchmarks, RL loops that rebuild engines) converts and transfers the weights once.
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from jaxpaged.models import checkpoint, loading
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.hf_weights import params_from_hf

logger = logging.getLogger("jaxpaged")
_FORMAT = "llama-scan-v1"  # bump when params_from_hf changes the parameter layout


@functools.lru_cache(maxsize=2)
def load_model(model: str | None, dtype: str):
    """Returns `(ModelConfig, params, Tokenizer)`; params are arrays in `dtype` (numpy or jax)."""
    files = loading.load_model_files(model, weights=False)
    config = ModelConfig.from_hf(files.hf_config, dtype=dtype)

    def convert():
        logger.info("converting %s to %s parameters (cached for the next start)", files.source_id, dtype)
        return params_from_hf(config, loading.load_model_files(model).state_dict)

    # A cache that cannot be read or written costs a conversion, never a failed start.
    params, _ = checkpoint.cached_params(files.source.weight_files(), jnp.dtype(dtype), convert, format_tag=_FORMAT)
    return config, params, files.tokenizer
