"""Engine arguments: one frozen dataclass that validates itself.

Defaults depend on the platform: a GPU serves many long sequences, a 2-core CPU a few short ones
(on the CPU, attention and the dense work per token are what bound speed, so max_model_len and the
token budget are kept moderate there).
"""

import logging
import os
from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "chunked", "reference", "pallas", "mosaic")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_DTYPES = ("auto", "int8", "float8_e4m3fn")  # the one definition (ops/kv_quant.py and the CLI read it)
# Weights as given, a .gguf's block codes kept (models/gguf_blocks.py), or a Hugging Face checkpoint's own
# quantization_config method (models/hf_quant.py; None reads it from the checkpoint, as vLLM does).
QUANTIZATIONS = (None, "gguf", "fp8", "compressed-tensors", "awq", "gptq", "dequantize")
FP8_ACTIVATIONS = ("float", "fp8")  # FP8 weights times float activations (W8A16) or FP8 ones (W8A8)
# quantization="gguf": the activations the codes multiply, float32 or Q8_1 blocks (ops/gguf_panels.py)
GGUF_ACTIVATIONS = ("float32", "q8_1")
# structured_outputs_config's keys (vLLM's engine argument). Its "backend" names vLLM's choices; jaxpaged
# always runs llguidance, with the named backend's JSON-schema semantics (below).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_additional_properties")
# vLLM's spellings of the same storage, accepted and stored under jaxpaged's name ("fp8" is e4m3 in vLLM).
KV_CACHE_DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
# preemption_mode="swap" without swap_space_bytes: vLLM's default swap space (4 GiB), at most this
# share of the host's memory (vLLM warns above 40% and refuses above 70%; so does EngineConfig).
DEFAULT_SWAP_SPACE_BYTES = 4 << 30
SWAP_SPACE_DEFAULT_SHARE, SWAP_SPACE_MAX_SHARE = 0.4, 0.7

logger = logging.getLogger("jaxpaged")


def strict_json_schemas(structured_outputs_config: dict | None) -> bool:
    """Whether objects of a JSON schema admit only the properties they name (additionalProperties
    false unless the schema says otherwise): vLLM's xgrammar ("auto", the default) does; its
    guidance backend does only with disable_additional_properties."""
    config = structured_outputs_config or {}
    if not isinstance(config, dict) or set(config) - set(STRUCTURED_OUTPUTS_KEYS):
        raise ValueError(f"structured_outputs_config={structured_outputs_config!r}: pass a dict with keys among "
                         f"{STRUCTURED_OUTPUTS_KEYS}, e.g. {{'backend': 'guidance'}}")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_config backend={backend!r}: use one of {STRUCTURED_OUTPUTS_BACKENDS} "
                         "(jaxpaged runs llguidance with that backend's JSON-schema semantics)")
    disable = config.get("disable_additional_properties")
    if disable is not None and not isinstance(disable, bool):
        raise ValueError(f"structured_outputs_config disable_additional_properties={disable!r} must be true or false")
    return backend != "guidance" or bool(disable)


def host_memory_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # KV pool size in pages (page 0 is the padding page); None: from memory
    kv_memory_fraction: float = 0.8  # GPU: share of the memory left after weights given to KV pages
    kv_memory_bytes: int | None = None  # explicit KV budget in bytes (wins over the fraction)
    max_num_seqs: int | None = None  # sequences per step; None: 256 on GPU, 16 on CPU
    max_num_batched_tokens: int | None = None  # tokens per step; None: 8192 on GPU, 256 on CPU
    max_model_len: int | None = None  # prompt + output tokens; None: min(model's, 4096 GPU / 1024 CPU)
    # Share the K/V of full pages between requests with the same prefix (a hash chain over pages, LRU
    # eviction; cache_salt keeps tenants apart).
    enable_prefix_caching: bool = True
    dtype: str | None = None  # "float32" | "bfloat16"; None: bfloat16 on GPU, float32 on CPU
    # K/V page storage: "auto" = the model dtype; "int8" / "float8_e4m3fn" = quantized values plus a
    # float32 scale per (token, KV head), about half (bf16) or a quarter (f32) of the bytes per token.
    # vLLM's "fp8" / "fp8_e4m3" are accepted and stored as "float8_e4m3fn". Not with attention_backend="mosaic".
    kv_cache_dtype: str = "auto"
    # "auto": "pallas" (the Triton kernels) on a GPU while JAX ships them (on the H100 profile Mosaic's decode
    # step is behind at batch 16-64), then "mosaic" where it serves; "chunked" on a CPU (jnp reading only the
    # pages the batch needs, with C++ kernels where a compiler is found; JAXPAGED_CPU_KERNELS=0 turns them off);
    # "reference": the plain oracle; "mosaic": the Hopper kernels (bfloat16 only); "pallas" on a CPU
    # runs the kernels in Pallas's interpreter, slowly.
    attention_backend: str = "auto"
    seed: int = 0  # draws the seeds of requests that give none
    warmup: bool = True  # precompile every bucket at start-up
    # Plan and prepare step n+1 while the device runs step n (tokens reach the host one step late).
    # False: each step waits for its own tokens (debugging; the benchmark's comparison).
    async_scheduling: bool = True
    tensor_parallel_size: int = 1  # devices one model is split over (a `tp` mesh axis; jaxpaged/device/sharding.py)
    data_parallel_size: int = 1  # whole engine replicas, each on its own tensor_parallel_size devices
    # Which replica a request goes to (jaxpaged/engine/prefix_routing.py): "least_loaded" (fewest
    # unfinished requests), "round_robin", or "prefix" (the replica sent its longest page prefix).
    data_parallel_routing: str = "least_loaded"
    # Out of pages, a victim's K/V is recomputed later ("recompute") or copied to host memory and
    # back ("swap", within swap_space_bytes of host pages; recompute when those are full).
    preemption_mode: str = "recompute"
    # Host bytes for swapped pages (preemption_mode="swap" only). None with "swap": vLLM's 4 GiB, at
    # most 40% of host memory (logged); more than 70% of host memory is refused.
    swap_space_bytes: int | None = None
    host_cache_bytes: int | None = None  # host tier under the device prefix cache; None: no tier
    # What logprobs report (vLLM's engine argument): "raw_logprobs" = the model's distribution;
    # "processed_logprobs" = the one each token was drawn from (penalties, bias, temperature, top-k/p, min-p).
    logprobs_mode: str = "raw_logprobs"
    # Speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}, or {"method": "draft_model", "model": path or
    # hub id, "num_speculative_tokens": k} (jaxpaged/spec_decode/); "disable_by_batch_size" too. None: off.
    speculative_config: dict | None = None
    # One weight buffer per layer, layers unrolled: the step copies no weight (jaxpaged/device/layer_params.py).
    # None: on a GPU (under tensor parallelism too: each layer's buffer split like its stacked leaf). Not on
    # a CPU by default: there it is at most 5% faster and each step program compiles ~5x longer.
    per_layer_weights: bool | None = None
    # MoE (vLLM's engine argument): CompletionOutput.routed_experts gets every fed token's top-k expert
    # ids per layer, [len(prompt) + len(output) - 1, num_layers, top_k] (engine/routed_experts.py).
    enable_return_routed_experts: bool = False
    # Default sampling parameters (vLLM's engine argument): "auto" = the model's generation_config.json
    # (temperature, top_p, top_k, min_p, penalties, max_new_tokens; a GGUF has none), "vllm" = none,
    # or a directory holding a generation_config.json. Used by LLM.generate without SamplingParams and
    # by the server for every field a request leaves out.
    generation_config: str = "auto"
    # vLLM's engine argument: Hugging Face generation keys ({"temperature": 0.5, "max_new_tokens": 64})
    # applied on top of generation_config's, "vllm" included.
    override_generation_config: dict | None = None
    # The most logprobs a request may ask for (vLLM's engine argument; at most 20, the width compiled).
    max_logprobs: int = 20
    # vLLM's engine argument. None: as vLLM resolves it, a .gguf model's "gguf" (float weights where a
    # feature needs them: tensor_parallel_size > 1, batch_invariant; a warning says so), a Hugging Face
    # checkpoint's quantization_config method, else weights in `dtype`. "gguf" (a .gguf model): layer projections
    # stored as Q4_0 / Q4_1 / Q8_0 stay as their block codes (0.75 bytes per weight for Q4, 1.25 for Q8_0), dequantized
    # layer by layer in the step to gguf's own float values (jaxpaged/models/gguf_blocks.py). "dequantize" (a .gguf
    # model; not a vLLM value): every weight dequantized to `dtype` at load, for float weight updates. "fp8",
    # "compressed-tensors", "awq", "gptq": the checkpoint's own method, kept packed (jaxpaged/models/hf_quant.py).
    quantization: str | None = None
    # A .gguf model's codes (quantization None or "gguf") on the CPU: "float32" multiplies the codes'
    # float values by float32 activations (vLLM's float32 CPU engine's tokens); "q8_1" quantizes each activation row to Q8_1
    # blocks of 32 and sums integer products (AVX512-VNNI), GGUF's own arithmetic, as vLLM's GGUF
    # kernels run on a GPU and llama.cpp on a CPU: 2.0-2.7x the float32 kernel's matmul rate, not
    # float32's tokens.
    gguf_activations: str = "float32"
    # FP8 weights of a quantized checkpoint (quant_method fp8 or compressed-tensors FP8): "float" multiplies
    # them dequantized by float activations (W8A16), "fp8" quantizes the activations to FP8 too (W8A8, as
    # vLLM on a GPU: the checkpoint's static input_scale, else per token or per token and 128-block).
    # None: "fp8" on a GPU, "float" on a CPU (jaxpaged/ops/fp8_matmul.py).
    fp8_activations: str | None = None
    # A request's tokens and logprobs bit for bit the same whatever else runs with it (batch, bucket,
    # chunking, prefix hits, preemption, replica), and equal to jaxpaged.rl.token_logprobs (an RL
    # trainer's forward). None: on when VLLM_BATCH_INVARIANT=1 (vLLM's switch). CPU path only
    # (jaxpaged/device/batch_invariant.py says what it fixes and refuses).
    batch_invariant: bool | None = None
    # vLLM's engine argument, keys "backend" and "disable_additional_properties". JSON schemas are
    # strict by default, as vLLM's default backend (xgrammar) compiles them: an object admits only
    # the properties it names unless its additionalProperties says otherwise. vLLM's way to relax:
    # {"backend": "guidance"} (extra keys allowed unless "disable_additional_properties": true).
    structured_outputs_config: dict | None = None
    # A grammar (JSON schema, regex, Lark) still compiling this long after its request arrived ends
    # that request with finish_reason "abort" (the engine keeps serving; the spec is not cached).
    grammar_compile_timeout_s: float = 30.0
    # Multi-LoRA (vLLM's engine arguments): requests may name a PEFT adapter (LoRARequest); adapters of
    # different requests run in one step through one grouped computation (jaxpaged/models/lora.py).
    enable_lora: bool = False
    max_loras: int = 1  # adapters resident on the device at once (slots); a step mixes at most this many
    max_lora_rank: int = 16  # the largest adapter rank accepted; every slot is padded to it
    max_cpu_loras: int | None = None  # adapters kept loaded on the host (LRU); None: max_loras

    def __post_init__(self):
        self.check_lora()
        if not (isinstance(self.grammar_compile_timeout_s, (int, float)) and self.grammar_compile_timeout_s > 0):
            raise ValueError(f"grammar_compile_timeout_s={self.grammar_compile_timeout_s!r} must be > 0 seconds")
        strict_json_schemas(self.structured_outputs_config)  # ValueError for unknown keys or values
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an int in [0, 20] (20 is the most "
                             "logprobs per token jaxpaged computes)")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config={self.override_generation_config!r} must be a dict of "
                             "Hugging Face generation keys, e.g. {'temperature': 0.5, 'max_new_tokens': 64}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: jaxpaged supports {QUANTIZATIONS[1:]} (a .gguf "
                             "model's own blocks, or the method of a checkpoint's quantization_config) or None")
        if self.fp8_activations not in (None, *FP8_ACTIVATIONS):
            raise ValueError(f"fp8_activations={self.fp8_activations!r} must be one of {FP8_ACTIVATIONS} or None")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations={self.gguf_activations!r} must be one of {GGUF_ACTIVATIONS}")
        if self.gguf_activations != "float32" and self.quantization not in (None, "gguf"):
            raise ValueError(f"gguf_activations={self.gguf_activations!r} quantizes the activations GGUF codes "
                             "multiply: it needs a .gguf model run as its codes (quantization None or 'gguf')")
        if self.quantization == "gguf" and self.tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' needs tensor_parallel_size=1 (GGUF blocks are not sharded yet); "
                             "pass quantization='dequantize' (or None) to shard float weights")
        if self.per_layer_weights and self.enable_return_routed_experts:
            raise ValueError("enable_return_routed_experts reads the layer scan's routed ids: leave per_layer_weights None")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", check_speculative_config(self.speculative_config))
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a positive power of two (16 is usual)")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is reserved for padding)")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or None for the platform default)")
        if (self.max_num_seqs and self.max_num_batched_tokens
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs}: every scheduled sequence computes at least one token")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (1: no parallelism)")
        if self.data_parallel_routing not in ("least_loaded", "round_robin", "prefix"):
            raise ValueError(f"data_parallel_routing={self.data_parallel_routing!r}: use 'least_loaded', "
                             "'round_robin' or 'prefix'")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: use one of {PREEMPTION_MODES}")
        for name in ("swap_space_bytes", "host_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 byte (or None for none)")
        if self.preemption_mode == "swap" and self.swap_space_bytes is None:
            default = min(DEFAULT_SWAP_SPACE_BYTES, int(SWAP_SPACE_DEFAULT_SHARE * host_memory_bytes()))
            object.__setattr__(self, "swap_space_bytes", default)
            logger.info("preemption_mode='swap': swap_space_bytes=%d (%.2f GiB; vLLM's default 4 GiB, at most "
                        "%d%% of host memory); pass swap_space_bytes to choose", default, default / 2**30,
                        SWAP_SPACE_DEFAULT_SHARE * 100)
        if self.swap_space_bytes is not None and self.swap_space_bytes > SWAP_SPACE_MAX_SHARE * host_memory_bytes():
            raise ValueError(
                f"swap_space_bytes={self.swap_space_bytes} is more than {SWAP_SPACE_MAX_SHARE:.0%} of this host's "
                f"{host_memory_bytes()} bytes of memory; lower it (leave it out for a default)")
        if self.swap_space_bytes is not None and self.preemption_mode != "swap":
            raise ValueError(f"swap_space_bytes={self.swap_space_bytes} is used only with preemption_mode='swap'")
        if self.host_cache_bytes is not None and not self.enable_prefix_caching:
            raise ValueError("host_cache_bytes is a tier of the prefix cache; set enable_prefix_caching=True")
        if self.enable_return_routed_experts and self.speculative_config is not None:
            raise ValueError("enable_return_routed_experts does not run with speculative_config yet; leave one unset")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode={self.logprobs_mode!r}: use 'raw_logprobs' or 'processed_logprobs'")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: use 'float32', 'bfloat16' or None")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r}: use one of {ATTENTION_BACKENDS}")
        if self.kv_cache_dtype in KV_CACHE_DTYPE_ALIASES:
            object.__setattr__(self, "kv_cache_dtype", KV_CACHE_DTYPE_ALIASES[self.kv_cache_dtype])
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: use one of {KV_CACHE_DTYPES} or vLLM's "
                             f"{tuple(KV_CACHE_DTYPE_ALIASES)} ('auto' stores K/V in the model dtype)")
        if self.attention_backend == "mosaic" and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"attention_backend='mosaic' reads bfloat16 pages only, not kv_cache_dtype={self.kv_cache_dtype!r}; "
                "use attention_backend='pallas' (or 'auto') for a quantized KV cache, or kv_cache_dtype='auto'")
        if self.batch_invariant:
            self.check_batch_invariant()
        if self.attention_backend == "mosaic" and self.dtype != "bfloat16":
            raise ValueError(
                f"attention_backend='mosaic' runs wgmma on bfloat16 pages, got dtype={self.dtype!r}; "
                "pass dtype='bfloat16'")

    def check_lora(self) -> None:
        """The LoRA arguments' own ranges, and the features adapters do not run with yet (refused by name)."""
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras} (vLLM's rule); "
                             "raise it or leave it None")
        if not self.enable_lora:
            return
        refused = {"speculative_config": self.speculative_config is not None,
                   "tensor_parallel_size": self.tensor_parallel_size > 1,
                   "data_parallel_size": self.data_parallel_size > 1, "batch_invariant": bool(self.batch_invariant)}
        given = [name for name, bad in refused.items() if bad]
        if given:
            raise ValueError(f"enable_lora=True does not run with {', '.join(given)} yet; leave them at their defaults")

    def check_batch_invariant(self) -> None:
        """The engine arguments batch_invariant=True refuses (the runner checks the model and the kernels)."""
        refused = {"speculative_config": self.speculative_config is not None,  # drafts change tokens by batch size
                   "quantization": self.quantization not in (None, "dequantize"), "kv_cache_dtype": self.kv_cache_dtype != "auto",
                   "tensor_parallel_size": self.tensor_parallel_size > 1, "dtype": self.dtype == "bfloat16",
                   "enable_return_routed_experts": self.enable_return_routed_experts}
        given = [name for name, bad in refused.items() if bad]
        if given:
            raise ValueError(f"batch_invariant=True (or VLLM_BATCH_INVARIANT=1) runs float32 weights and KV on one "
                             f"device per replica without speculation; {', '.join(given)} cannot be batch-invariant: "
                             "leave them at their defaults")

    def batch_invariant_requested(self) -> bool:
        """batch_invariant, None read from VLLM_BATCH_INVARIANT (vLLM's switch)."""
        if self.batch_invariant is None:
            return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip() == "1"
        return bool(self.batch_invariant)

    def resolved(self, *, on_gpu: bool, model_max_len: int) -> "EngineConfig":
        """The same config with every None default filled in for this platform and model."""
        from dataclasses import replace

        max_model_len = self.max_model_len or min(model_max_len, 4096 if on_gpu else 1024)
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context of {model_max_len} tokens; "
                f"lower max_model_len")
        max_num_seqs = self.max_num_seqs or default_max_num_seqs(on_gpu)
        max_num_batched_tokens = self.max_num_batched_tokens or max(max_num_seqs, 8192 if on_gpu else 256)
        batch_invariant = self.batch_invariant_requested()
        return replace(  # (__post_init__ checks batch_invariant, VLLM_BATCH_INVARIANT's included)
            self,
            batch_invariant=batch_invariant,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=self.dtype or ("bfloat16" if on_gpu else "float32"),
            attention_backend=(
                ("pallas" if on_gpu else "chunked") if self.attention_backend == "auto" else self.attention_backend
            ),
        )


# vLLM `LLM(...)` / engine arguments that have a jaxpaged name or meaning (jaxpaged's own names work too).
VLLM_RENAMED_ARGS = {"block_size": "page_size", "kv_cache_memory_bytes": "kv_memory_bytes",
                     # vLLM: the share of device memory for weights, activations and KV; jaxpaged: the share
                     # of the memory left after the weights that goes to KV pages (the closest knob).
                     "gpu_memory_utilization": "kv_memory_fraction"}
# Accepted, with an INFO line saying why they change nothing here.
VLLM_NO_EFFECT_ARGS = {
    "enforce_eager": "jaxpaged always runs compiled XLA programs (there are no CUDA graphs to turn off)",
    "trust_remote_code": "jaxpaged runs no model code from the hub, only its own model definitions",
    "enable_sleep_mode": "LLM.sleep / wake_up are always available",
    "disable_log_stats": "jaxpaged logs no periodic statistics (the server's /metrics has them)",
    "max_seq_len_to_capture": "there are no CUDA graphs to capture",
    "disable_custom_all_reduce": "collectives are XLA's",
}
# Accepted at their default value only; anything else is refused by name.
VLLM_DEFAULT_ONLY_ARGS = {"tokenizer": None, "tokenizer_mode": "auto", "skip_tokenizer_init": False,
                          "revision": None, "tokenizer_revision": None,
                          "load_format": "auto", "distributed_executor_backend": None, "cpu_offload_gb": 0,
                          "max_logprobs": 20, "pipeline_parallel_size": 1}
VLLM_DTYPES = {"auto": None, "float": "float32", "float32": "float32", "bfloat16": "bfloat16"}


def engine_args_from_vllm(model: str | None, kwargs: dict) -> dict:
    """`LLM(model, **kwargs)` written for vLLM, as EngineConfig's keyword arguments: vLLM's names
    renamed, arguments that change nothing here accepted with an INFO line, the rest refused by
    name unless at vLLM's default. jaxpaged's own arguments pass through unchanged."""
    kwargs = dict(kwargs)
    for old, new in VLLM_RENAMED_ARGS.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(f"{old} and {new} are the same setting; pass one")
            kwargs[new] = kwargs.pop(old)
    for name, why in VLLM_NO_EFFECT_ARGS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            logger.info("%s=%r has no effect: %s", name, value, why)
    for name, default in VLLM_DEFAULT_ONLY_ARGS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if name == "tokenizer" and value is not None and value == model:
                continue  # the model's own tokenizer, named
            if name == "max_logprobs" and isinstance(value, int) and 0 <= value <= default:
                kwargs["max_logprobs"] = value
                continue
            if value != default:
                allowed = "0..20 (20 is the most jaxpaged computes)" if name == "max_logprobs" else \
                    f"only {default!r}, vLLM's default"
                raise ValueError(f"{name}={value!r} is not supported by jaxpaged ({allowed}); leave it out")
    if "swap_space" in kwargs:  # GiB, vLLM's unit
        gib = kwargs.pop("swap_space")
        if kwargs.get("preemption_mode") == "swap":
            if "swap_space_bytes" in kwargs:
                raise ValueError("swap_space and swap_space_bytes are the same setting; pass one")
            kwargs["swap_space_bytes"] = int(gib * (1 << 30))
        else:
            logger.info("swap_space=%r has no effect: preemption recomputes, as vLLM's V1 engine does; pass "
                        "preemption_mode='swap' to swap to host memory", gib)
    if kwargs.get("dtype") in VLLM_DTYPES:
        kwargs["dtype"] = VLLM_DTYPES[kwargs["dtype"]]
    if "seed" in kwargs and kwargs["seed"] is None:  # vLLM: no fixed seed
        kwargs["seed"] = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    return kwargs


def default_max_num_seqs(on_gpu: bool) -> int:
    """max_num_seqs when none is given: 256 on a GPU (vLLM's), 16 on the CPU."""
    return 256 if on_gpu else 16


SPECULATIVE_METHODS = ("ngram", "draft_model")


def check_speculative_config(spec: dict) -> dict:
    """vLLM's speculative_config dict, validated, with defaults filled in (a new dict)."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {type(spec).__name__}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
             "disable_by_batch_size"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; use {sorted(known)}")
    method = spec.get("method", "draft_model" if "model" in spec else "ngram")  # vLLM infers it from 'model' too
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config method={method!r} is not supported; use one of {SPECULATIVE_METHODS}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config needs num_speculative_tokens, an int in [1, 16]; got {k!r}")
    lookup_min = spec.get("prompt_lookup_min", 1)
    lookup_max = spec.get("prompt_lookup_max", max(5, lookup_min) if isinstance(lookup_min, int) else 5)
    for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
    # vLLM's key: no proposals while more requests than this are in the engine (a large batch is
    # compute-bound: verifying k extra tokens per sequence costs more than it saves). None: 1 on the
    # CPU (measured: benchmarks/bench_spec_decode.py), 32 elsewhere (not measured).
    disable = spec.get("disable_by_batch_size")
    if disable is not None and (not isinstance(disable, int) or isinstance(disable, bool) or disable < 1):
        raise ValueError(f"speculative_config disable_by_batch_size={disable!r} must be an int >= 1 (or None)")
    checked = {"method": method, "num_speculative_tokens": k, "prompt_lookup_max": lookup_max,
               "prompt_lookup_min": lookup_min, "disable_by_batch_size": disable}
    if method == "draft_model":
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config method='draft_model' needs 'model': a path or hub id of a smaller "
                             f"model with the same tokenizer; got {model!r}")
        if "prompt_lookup_max" in spec or "prompt_lookup_min" in spec:
            raise ValueError("speculative_config prompt_lookup_max/min are for method='ngram'; drop them")
        return {"method": method, "model": model, "num_speculative_tokens": k, "disable_by_batch_size": disable}
    if "model" in spec:
        raise ValueError(f"speculative_config 'model' is for method='draft_model', not {method!r}")
    return checked
