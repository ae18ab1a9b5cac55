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

from jaxpaged.models import checkpoint, gguf_blocks, hf_quant, loading
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.hf_weights import params_from_hf

logger = logging.getLogger("jaxpaged")
_FORMAT = "llama-scan-v1"  # bump when params_from_hf changes the parameter layout


@functools.lru_cache(maxsize=2)
def load_model(model: str | None, dtype: str, quantization: str | None = None, *, require_kept: bool = True):
    """Returns `(ModelConfig, params, Tokenizer)`; params are arrays in `dtype` (numpy or jax).
    quantization="gguf": a .gguf model's Q4_0 / Q4_1 / Q8_0 layer projections stay block codes
    (models/gguf_blocks.py; a file with none is refused unless not `require_kept`: EngineConfig's None,
    engine/build.py); other sources are refused. None or "dequantize": a .gguf dequantized to `dtype`."""
    files = loading.load_model_files(model, weights=False)
    keep_blocks = quantization == "gguf"
    if quantization in ("gguf", "dequantize") and files.source.kind != "gguf":
        raise ValueError(f"quantization={quantization!r} is for a .gguf file's blocks, but {files.source_id!r} is "
                         "not a .gguf file; pass a .gguf model or leave quantization None")
    if quantization == "dequantize":
        quantization = None
    hf_quantization = (files.hf_config.get("quantization_config") or None) if files.source.kind != "gguf" else None
    method = hf_quant.method_of(hf_quantization)
    if method == "mxfp4":  # gpt-oss's experts, dequantized as they load (models/mxfp4.py); hf_config checks the family
        hf_quantization, method = None, None
    if quantization not in (None, "gguf", method):
        raise ValueError(f"quantization={quantization!r}, but {files.source_id!r} is "
                         + (f"a {method!r} checkpoint" if method else "not quantized")
                         + "; leave quantization None (it is read from the checkpoint's quantization_config)")
    config = ModelConfig.from_hf(files.hf_config, dtype=dtype)

    def convert():
        logger.info("converting %s to %s parameters%s (cached for the next start)", files.source_id, dtype,
                    " with GGUF block codes" if keep_blocks else f" with {method} weights kept" if method else "")
        state_dict = loading.load_model_files(model, keep_blocks=keep_blocks).state_dict
        if hf_quantization:
            state_dict = hf_quant.quantized_state_dict(hf_quantization, state_dict)
        return params_from_hf(config, state_dict)

    # A cache that cannot be read or written costs a conversion, never a failed start. gguf-blocks-v3:
    # 4-bit codes packed two per byte, a tied embedding kept as codes (models/gguf_blocks.py).
    params, _ = checkpoint.cached_params(files.source.weight_files(), jnp.dtype(dtype), convert,
                                         format_tag=_FORMAT + ("-gguf-blocks-v3" if keep_blocks else "")
                                         + (f"-{method}-v1" if method else ""))
    if keep_blocks and require_kept:
        check_kept(params, files.source_id)
    return config, params, files.tokenizer


def check_kept(params, source_id: str) -> None:
    """quantization="gguf": refuses a file none of whose projections are Q4_0 / Q4_1 / Q8_0 (it would
    run as float, not as asked); names the projections that stay float in a mixed file."""
    kept = gguf_blocks.kept_projections(params)
    if not kept:
        raise ValueError(f"quantization='gguf' keeps Q4_0 / Q4_1 / Q8_0 projections, and {source_id!r} has none "
                         "(its layers use other block types, e.g. K quants, which jaxpaged dequantizes at load); "
                         "leave quantization None (it dequantizes such a file) or pass quantization='dequantize'")
    if len(kept) < len(gguf_blocks.PROJECTIONS):
        logger.warning("quantization='gguf': %s of %s stay float (a layer stores them in a block type other than "
                       "Q4_0 / Q4_1 / Q8_0)", [n for n in gguf_blocks.PROJECTIONS if n not in kept], source_id)
