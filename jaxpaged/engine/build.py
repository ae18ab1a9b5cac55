"""From a model name and engine arguments to a running engine: the one place that decides.

    EngineConfig ─► devices checked ─► model loaded ─► config resolved for the platform
                ─► attention backend ─► KV pool size ─► LLMEngine, or data_parallel_size of them
"""

from __future__ import annotations

import dataclasses
import logging

from jaxpaged.config import EngineConfig, default_max_num_seqs
from jaxpaged.device.backends import attention_fn as backend_attention_fn
from jaxpaged.device.backends import gpu_auto_backend
from jaxpaged.device.kv_cache import CPU_KV_BUDGET_BYTES, num_pages_for, on_gpu
from jaxpaged.device.sharding import replica_meshes
from jaxpaged.engine.data_parallel import DataParallelEngine
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.engine.protocol import EngineClient
from jaxpaged.models.gguf_blocks import has_kept_weights
from jaxpaged.models.hf_quant import quantized_leaves
from jaxpaged.models.loading import resolve_model, generation_config_file, generation_eos_ids, sampling_defaults
from jaxpaged.models.weights import load_model
from jaxpaged.planner.request import SamplingParams

logger = logging.getLogger(__name__)


# The most sequences a batch sized from the pool may hold (vLLM's default max_num_seqs).
MAX_NUM_SEQS_FROM_POOL = 256


def build_engine(model: str | None, config: EngineConfig, *, max_num_seqs_from_pool: bool = False) -> EngineClient:
    """Loads `model` (None: the bundled SmolLM2) and builds the engine `config` describes.

    `max_num_seqs_from_pool` (the server's default): with no max_num_seqs given, the KV pool is
    sized first (on the CPU: the whole host KV budget, not one default batch's worth) and the batch
    from it: as many sequences as the pool holds at max_model_len tokens each (vLLM's "maximum
    concurrency"), never fewer than the platform's default, at most MAX_NUM_SEQS_FROM_POOL, so
    requests the pool has room for do not queue.
    """
    # Before loading: too few devices is an error the user should see at once.
    replica_meshes(config.data_parallel_size, config.tensor_parallel_size)
    # The generation config, read once: sampling defaults and end tokens, refused before loading if bad.
    generation_file = generation_config_file(model, config.generation_config)
    defaults = checked_generation_defaults(sampling_defaults(
        {} if config.generation_config == "vllm" else generation_file, config.override_generation_config))
    eos_ids = generation_eos_ids(generation_file, None)
    dtype = config.dtype or ("bfloat16" if on_gpu() else "float32")
    auto_backend = config.attention_backend == "auto"
    chosen = config.quantization is not None
    config = gguf_default(model, config)
    model_config, params, tokenizer = load_model(model, dtype=dtype, quantization=config.quantization,
                                                 require_kept=chosen)
    if config.quantization == "gguf" and not has_kept_weights(params):  # None on a .gguf of no Q4_0 / Q4_1 / Q8_0
        logger.info("%s keeps no Q4_0 / Q4_1 / Q8_0 projections: its weights run dequantized to %s",
                    model or "the default model", dtype)
        config = dataclasses.replace(config, quantization="dequantize")
    if config.tensor_parallel_size > 1 and quantized_leaves(params):  # packed leaves are not sharded yet
        raise ValueError(f"{model!r} keeps quantized weights ({quantized_leaves(params)[0]}, ...), which are not sharded "
                         "yet: use tensor_parallel_size=1 (data_parallel_size replicates them), or the unquantized model")
    model_config = dataclasses.replace(model_config, gguf_activations=config.gguf_activations,
                                       fp8_activations=config.fp8_activations or ("fp8" if on_gpu() else "float"))
    eos_ids = tuple(t for t in eos_ids if t != tokenizer.eos_token_id)  # the tokenizer's own eos stops anyway
    if any(t >= model_config.vocab_size for t in eos_ids):
        raise ValueError(f"generation_config.json's eos_token_id lists {list(eos_ids)}, outside the vocabulary "
                         f"[0, {model_config.vocab_size}); fix the file or pass another generation_config directory")
    from_pool = max_num_seqs_from_pool and config.max_num_seqs is None
    if from_pool and config.num_pages is None and config.kv_memory_bytes is None and not on_gpu():
        config = dataclasses.replace(config, kv_memory_bytes=CPU_KV_BUDGET_BYTES)
    if from_pool:  # the largest batch, for sizing the pool (a GPU compiles its largest step for it)
        config = dataclasses.replace(config, max_num_seqs=MAX_NUM_SEQS_FROM_POOL)
    config = config.resolved(on_gpu=on_gpu(), model_max_len=model_config.max_position_embeddings)
    if auto_backend and on_gpu():  # Triton while JAX ships it, then Mosaic where it serves (device/backends.py)
        import jax

        capability = getattr(jax.devices()[0], "compute_capability", "")
        config = dataclasses.replace(config, attention_backend=gpu_auto_backend(
            model_config, config, compute_capability=capability))
    attention_fn = backend_attention_fn(config.attention_backend, batch_invariant=config.batch_invariant)
    num_pages = num_pages_for(config, model_config, params, attention_fn)
    if from_pool:
        config = dataclasses.replace(config, max_num_seqs=pool_max_num_seqs(num_pages, config, on_gpu()))
    draft_model = None
    spec = config.speculative_config
    if spec is not None and spec["method"] == "draft_model":  # the draft's pool is sized as the target's (DESIGN.md)
        draft_config, draft_params, _ = load_model(spec["model"], dtype=config.dtype)
        draft_model = (draft_config, draft_params)
    engine = engine_from_parts(model_config, params, tokenizer, config, num_pages=num_pages, attention_fn=attention_fn,
                               draft_model=draft_model)
    for replica in getattr(engine, "engines", [engine]):  # a DataParallelEngine reads its first replica's
        replica.generation_defaults = dict(defaults)
        replica.generation_eos_ids = eos_ids
    return engine


def gguf_default(model: str | None, config: EngineConfig) -> EngineConfig:
    """vLLM's rule: quantization None on a .gguf model means "gguf", its block codes served as they are
    (models/gguf_blocks.py), except where a feature asked for needs float weights: then "dequantize",
    with a warning naming the feature. "dequantize" on any other model is refused by name."""
    is_gguf = resolve_model(model).kind == "gguf"
    if config.quantization == "dequantize" and not is_gguf:
        raise ValueError(f"quantization='dequantize' dequantizes a .gguf model's blocks, and {model!r} is not a .gguf "
                         "file; leave quantization None")
    if config.quantization is not None or not is_gguf:
        return config
    needs_float = {"tensor_parallel_size > 1": config.tensor_parallel_size > 1,  # GGUF blocks are not sharded yet
                   "batch_invariant": config.batch_invariant_requested()}  # float32 dense kernels only
    given = [name for name, needed in needs_float.items() if needed]
    if given:
        logger.warning("%s is a .gguf model, served as its block codes by default (quantization='gguf', as vLLM "
                       "does), but %s needs float weights: dequantizing every weight at load instead (pass "
                       "quantization='dequantize' to ask for that)", model or "the default model", " and ".join(given))
        return dataclasses.replace(config, quantization="dequantize")
    return dataclasses.replace(config, quantization="gguf")


def checked_generation_defaults(defaults: dict) -> dict:
    """`defaults` (SamplingParams fields from a generation_config), refused at once if SamplingParams would."""
    if defaults:
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as err:
            raise ValueError(f"the generation config gives invalid sampling defaults {defaults} ({err}); "
                             "fix override_generation_config, or pass generation_config='vllm' to ignore the "
                             "model's file") from None
        logger.warning("Default sampling parameters have been overridden by the model's generation config: %s "
                       "(pass generation_config='vllm' for SamplingParams' own defaults)", defaults)
    return defaults


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


def pool_max_num_seqs(num_pages: int, config: EngineConfig, on_gpu: bool) -> int:
    """Sequences of max_model_len tokens the pool's usable pages hold at once, at least the
    platform's default max_num_seqs, at most MAX_NUM_SEQS_FROM_POOL and one step's token budget."""
    pages_per_seq = -(-config.max_model_len // config.page_size)
    concurrency = max((num_pages - 1) // pages_per_seq, default_max_num_seqs(on_gpu))
    return max(1, min(concurrency, MAX_NUM_SEQS_FROM_POOL, config.max_num_batched_tokens))
