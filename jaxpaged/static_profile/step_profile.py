"""One engine step program, compiled for an H100 or H200 and read: what `bench_h100_static` and the CI gate report.

Runs inside the H100 child process (jaxpaged/static_profile/target.py). The program is the engine's own:
a compile-only `ModelRunner` (abstract params on the virtual chip, jaxpaged/device/runner.py) traces
the same jitted, donated step the engine runs, for a decode bucket or a mixed token bucket; with
`tp` > 1 over a mesh of that many virtual chips, and then every byte figure is one device's (its
shards, its KV heads), its collectives' payload and NVLink bus bytes beside them.

    bytes per step  = HLO accounting of every launch, the KV buffer counted by the pages the step
                      really reads (the live context), not by its size
    ideal bytes     = weights once (an untied embedding: the gathered rows) + live KV once + the step's
                      own inputs and outputs (the packed int32 input, the new tokens' K/V written,
                      float32 logits)
    floors (ms)     = floors.py, for both chips from the one program: bytes / HBM bandwidth, + launches
                      x floors.PER_LAUNCH_S (launch-aware), NVLink; compute floor = useful FLOPs / 989 TFLOP/s
    command_buffers = from the dumped thunks: CUDA graphs per step, ops in them, host launches

Every figure is an estimate read from the compiled program; nothing here runs on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.static_profile.hlo_accounting import BufferOverride, account, entry_param_number
from jaxpaged.static_profile.ptxas_report import report as ptxas_report
from jaxpaged.static_profile.floors import bus_bytes, floors
from jaxpaged.static_profile.target import TARGETS, chip_mesh, chip_sharding, compile_for_h100
from jaxpaged.static_profile.thunks import count_dumped_thunks
from jaxpaged.device.backends import attention_fn
from jaxpaged.device.runner import ModelRunner
from jaxpaged.device.step_input import pack_step_input
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gguf_blocks import PROJECTIONS
from jaxpaged.models.llama import param_shapes
from jaxpaged.models.qwen3_next import param_shapes as hybrid_param_shapes, state_bytes_per_slot
from jaxpaged.models.rope_scaling import Yarn
from jaxpaged.ops.kv_quant import bytes_per_token_head

PAGE_SIZE = 16
MODELS = {  # shapes only: weights are abstract
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, qk_norm=True, tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    # Mixtral-8x7B (top-2 of 8 experts). Its 32 layers are 93 GB in bf16, over one H100's 80 GB: the
    # cases run it with num_layers=16 (47 GB), and per-layer figures are what carries over.
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=14336),
    # Gemma-2-9B: local (window 4096) and global layers alternating, soft caps, sandwich norms, gelu.
    "gemma2-9b": dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16,
                      num_kv_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                      layer_types=("sliding_attention", "full_attention") * 21, attn_soft_cap=50.0,
                      final_soft_cap=30.0, norm_plus_one=True, sandwich_norms=True, scale_embedding=True,
                      hidden_act="gelu_tanh", tie_word_embeddings=True),
    # gpt-oss-20b: 24 layers alternating sliding (window 128) and full attention with per-head sinks, q/k/v/o bias,
    # top-4 of 32 experts with biases and the clamped SwiGLU, YaRN (factor 32 over 4096); its MXFP4 experts
    # dequantized to bf16 at load (41.8 GB of weights).
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=24, num_heads=64,
                        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150000.0,
                        rope_scaling=Yarn(32.0, 4096, 32.0, 1.0, False, 0.1 * math.log(32.0) + 1.0),
                        attention_bias=True, o_proj_bias=True, sliding_window=128,
                        layer_types=("sliding_attention", "full_attention") * 12, num_experts=32, num_experts_per_tok=4,
                        moe_intermediate_size=2880, moe_bias=True, attention_sinks=True, hidden_act="swigluoai"),
    # Qwen3-Next-80B-A3B (its published config.json, written out here): 48 layers, every 4th gated full attention
    # (16 query / 2 KV heads of 256, RoPE on a quarter of head_dim), the others Gated DeltaNet (16 key / 32 value
    # heads of 128, conv kernel 4: a 72 MiB float32 state per sequence over 36 layers); top-10 of 512 experts
    # of 512 plus a shared expert of 512. 160 GB of bf16 weights: the cases run a slice (num_layers).
    "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_layers=48,
                               num_heads=16, num_kv_heads=2, head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7,
                               qk_norm=True, norm_plus_one=True, attn_output_gate=True, partial_rotary_factor=0.25,
                               layer_types=("linear_attention",) * 3 + ("full_attention",),  # repeated
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512, norm_topk_prob=True,
                               shared_expert_intermediate_size=512),
}


@dataclasses.dataclass(frozen=True)
class StepCase:
    model: str  # a MODELS key
    backend: str  # "pallas" | "mosaic"
    kv_cache_dtype: str  # "auto" | "int8" | "float8_e4m3fn"
    num_seqs: int  # sequences in the step
    context: int  # tokens of K/V each sequence reads (its prompt + outputs so far)
    num_tokens: int = 0  # mixed steps: tokens computed (0: a decode step, one per sequence)
    num_layers: int | None = None  # override (the CI gate's 2-layer model with real widths)
    num_logits: int = 0  # logits rows (a speculative verification step: num_seqs * (1 + k)); 0: one per sequence
    max_num_seqs: int | None = None  # the runner's max_num_seqs (its decode buckets); None: max(num_seqs, 2)
    chip: str = "h100"  # the compile target: "h100" | "h200" (target.TARGETS)
    tp: int = 1  # tensor parallel: a mesh of this many virtual chips; every byte figure is then per device
    # the attention batch_invariant=True would run on a GPU (device/batch_invariant.py): the Pallas ragged
    # kernel in every step, decode steps included; the GEMMs stay XLA's (not invariant: refused at run time)
    invariant_attention: bool = False
    # Layer projections as a quantized checkpoint keeps them (models/hf_quant.py): "auto" (the model dtype),
    # "fp8-channel" (float8 + a scale per output channel) or "fp8-block" (128x128 blocks); FP8 runs W8A8.
    # "w4a16": 4-bit codes packed two per byte, float32 scales and mins per 32 in-features (an AWQ / GPTQ /
    # compressed-tensors W4A16 checkpoint as models/hf_quant.py keeps it), multiplied by ops/w4a16_matmul.py.
    weights: str = "auto"
    # Multi-LoRA: this many adapter slots of rank lora_rank on every attention and MLP projection (the
    # step's cost does not depend on which slots the tokens use: models/lora.py); 0: no adapters.
    num_loras: int = 0
    lora_rank: int = 16

    @property
    def decode(self) -> bool:
        return self.num_tokens == 0


def model_config(case: StepCase) -> ModelConfig:
    shape = dict(MODELS[case.model], dtype="bfloat16", max_position_embeddings=1 << 20)
    if case.weights.startswith("fp8"):
        shape["fp8_activations"] = "fp8"
    if case.num_layers is not None:
        shape["num_layers"] = case.num_layers
    if shape.get("layer_types") is not None:  # a pattern repeated over the layers (a slice keeps it)
        pattern = shape["layer_types"]
        shape["layer_types"] = tuple(pattern[i % len(pattern)] for i in range(shape["num_layers"]))
    return ModelConfig(**shape)


def profile(case: StepCase, *, kernels: bool = True) -> dict:
    """Compile `case`'s step for the H100 and return its figures (a JSON-ready dict)."""
    config = model_config(case)
    mesh = chip_mesh(case.chip, case.tp) if case.tp > 1 else None  # the runner lays params out over it
    sharding = chip_sharding(case.chip) if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = hybrid_param_shapes(config) if config.is_hybrid else quantized_shapes(param_shapes(config), case.weights)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)
    pages_per_seq = math.ceil(case.context / PAGE_SIZE)
    num_tokens = case.num_seqs if case.decode else case.num_tokens
    max_num_seqs = case.max_num_seqs or max(case.num_seqs, 2)
    runner = ModelRunner(  # decode: the runner's own decode buckets for max_num_seqs
        config, params, num_pages=case.num_seqs * pages_per_seq + 1, page_size=PAGE_SIZE,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max(num_tokens, max_num_seqs),
        max_model_len=pages_per_seq * PAGE_SIZE, attention_fn=attention_fn(case.backend, platform="cuda",
                                                                             batch_invariant=case.invariant_attention),
        buckets=(max(num_tokens, max_num_seqs),), decode_buckets=None if case.decode else (),
        kv_cache_dtype=case.kv_cache_dtype, mesh=mesh, lora=(case.num_loras, case.lora_rank) if case.num_loras else None,
        num_state_slots=max_num_seqs if config.is_hybrid else 0,  # a hybrid model: a state slot per sequence
    )
    bucket = min(b for b in runner.decode_buckets if b >= case.num_seqs) if case.decode else num_tokens
    step_input = runner.dummy_step_input(bucket, decode_only=case.decode)
    if case.num_logits:  # a verification step: logits at every proposal position
        step_input = dataclasses.replace(step_input, logits_indices=np.zeros(case.num_logits, np.int32))
    packed, layout = pack_step_input(step_input)
    out = compile_for_h100(
        runner._step, (runner.served_params, runner._kv_state(), runner._abstract(packed), runner._no_prev_tokens,
                      runner.kv_centres, None if runner.lora is None else runner.lora.stacks),
        kwargs=dict(layout=layout, decode_only=case.decode), dump_dir=True)
    try:
        figures = _figures(case, config, runner, out, num_tokens)
        graphs = count_dumped_thunks(out.dump_dir)  # CUDA graphs: what the host launches of the step
        figures["command_buffers"] = {"graphs": graphs.command_buffers, "ops_in_graphs": graphs.ops_in_command_buffers,
                                      "host_launches": graphs.host_launches}
        if kernels:
            figures["kernels"] = [dataclasses.asdict(k) for k in ptxas_report(out.dump_dir)]
    finally:
        if out.dump_dir:
            shutil.rmtree(out.dump_dir, ignore_errors=True)
    return figures


def quantized_shapes(shapes, weights: str):
    """`param_shapes` with each layer projection as FP8 leaves (`name_fp8` [L, in, out] float8_e4m3fn,
    `name_fp8_scale` [L, G, out] float32: G = 1 per channel, in / 128 for blocks); "auto": unchanged."""
    if weights == "auto":
        return shapes
    if weights not in ("fp8-channel", "fp8-block", "w4a16"):
        raise ValueError(f"weights={weights!r}: 'auto', 'fp8-channel', 'fp8-block' or 'w4a16'")
    layers = dict(shapes["params"]["layers"])
    for module in ("attn", "mlp"):
        leaves = dict(layers[module])
        for name in PROJECTIONS:
            if name not in leaves:
                continue
            shape = leaves.pop(name).shape  # [L, in..., out...]: o_proj's in is (heads, head_dim)
            k = math.prod(shape[1:3]) if name == "o_proj" else shape[1]
            n = math.prod(shape[1:]) // k
            if weights == "w4a16":  # models/gguf_blocks.py's leaves: codes [L, in/32, 16, out], scales and mins
                leaves[name + "_codes"] = jax.ShapeDtypeStruct((shape[0], k // 32, 16, n), jnp.uint8)
                leaves[name + "_scales"] = leaves[name + "_mins"] = jax.ShapeDtypeStruct((shape[0], k // 32, n), jnp.float32)
                continue
            groups = 1 if weights == "fp8-channel" else k // 128
            leaves[name + "_fp8"] = jax.ShapeDtypeStruct((shape[0], k, n), jnp.float8_e4m3fn)
            leaves[name + "_fp8_scale"] = jax.ShapeDtypeStruct((shape[0], groups, n), jnp.float32)
        layers[module] = leaves
    return {**shapes, "params": {**shapes["params"], "layers": layers}}


def _device_bytes(tree) -> int:
    """Bytes one device holds of abstract leaves (a sharded leaf: its shard; replicated: all of it)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _figures(case: StepCase, config: ModelConfig, runner, out, num_tokens: int) -> dict:
    token_head = bytes_per_token_head(case.kv_cache_dtype, config.dtype, config.head_dim)  # scales included
    # Under tensor parallelism every figure is one device's: its KV heads (replicas included), its shards.
    kv_heads = runner.config.num_kv_heads // case.tp
    # Live K/V per layer; a sliding-window layer reads at most its window. The accounting's override is
    # per launch, so windowed models use the mean over layers (exact when context <= window).
    read = [min(case.context, w) if w is not None else case.context for w in config.layer_windows]
    live_kv_per_layer = case.num_seqs * (sum(read) // len(read)) * kv_heads * 2 * token_head  # K and V
    kv_layers = config.num_kv_layers  # a hybrid model's full-attention layers (its linear ones keep no K/V)
    # The pool is one entry parameter, or two for a quantized one (values, scales): one buffer to the
    # accounting, read per launch as the live context's values and scales (token_head counts both).
    # (A hybrid model's step state is the pair (kv_pages, (conv, recurrent)): the pool is its first element.)
    kv_name = "kv_pages[0]" if config.is_hybrid else "kv_pages"
    kv_param = (entry_param_number(out.hlo_text, kv_name) if case.kv_cache_dtype == "auto" else
                tuple(entry_param_number(out.hlo_text, f"kv_pages.{leaf}") for leaf in ("pages", "scales")))
    acc = account(out.hlo_text, BufferOverride(kv_param, bytes_read=live_kv_per_layer))
    weight_bytes = _device_bytes(runner.served_params)
    # MoE: a step needs only the experts its tokens are routed to; with uniform routing, an expert is
    # hit by some of T tokens with probability 1 - (1 - k/E)^T. Experts' FLOPs are k/E of theirs per token.
    expert_bytes = _device_bytes([x for path, x in jax.tree_util.tree_flatten_with_path(runner.served_params)[0]
                                  if "expert_" in jax.tree_util.keystr(path) and "shared_expert" not in
                                  jax.tree_util.keystr(path)])
    active = config.num_experts_per_tok / config.num_experts if config.num_experts else 0.0
    touched = 1 - (1 - active) ** num_tokens if config.num_experts else 0.0
    new_kv = num_tokens * kv_layers * kv_heads * 2 * token_head
    # A hybrid model's decode reads and writes every sequence's recurrent state (conv + delta rule) once.
    state_bytes = 2 * case.num_seqs * state_bytes_per_slot(config) if config.is_hybrid else 0
    num_logits = case.num_logits or case.num_seqs
    io = new_kv + num_logits * config.vocab_size * 4 + 4 * (8 * num_tokens + case.num_seqs * runner.pages_per_seq)
    # An untied embedding is only gathered (the step's tokens' rows); a tied one is the LM head, read whole.
    embedding_bytes = 0 if config.tie_word_embeddings else _device_bytes(runner.served_params["params"]["embedding"])
    gathered = 0 if config.tie_word_embeddings else num_tokens * config.hidden_size * jnp.dtype(config.dtype).itemsize
    # Adapters: every slot but the base model's zeros, read once (the ideal counts the adapters' bytes).
    lora_bytes = 0 if runner.lora is None else _device_bytes(runner.lora.stacks) * case.num_loras // (case.num_loras + 1)
    ideal = (weight_bytes - embedding_bytes + gathered - expert_bytes + touched * expert_bytes
             + live_kv_per_layer * kv_layers + io + lora_bytes + state_bytes)
    # Useful FLOPs: 2 x matmul weights x tokens (the LM head for the sampled rows only) + attention.
    embed = config.vocab_size * config.hidden_size // case.tp  # split by vocabulary under tensor parallelism
    # (FP8 weights: their elements counted as bf16 ones would be, their scales not at all.)
    flat = jax.tree_util.tree_flatten_with_path(runner.served_params)[0]
    fp8_bytes = _device_bytes([x for _, x in flat if x.dtype == jnp.float8_e4m3fn])
    scale_bytes = _device_bytes([x for path, x in flat if jax.tree_util.keystr(path).endswith(("_fp8_scale']", "_input_scale']"))])
    # (packed 4-bit codes: two weights a byte, counted as bf16 ones would be; their scales and mins not at all.)
    codes_bytes = _device_bytes([x for path, x in flat if jax.tree_util.keystr(path).endswith("_codes']")])
    scale_bytes += _device_bytes([x for path, x in flat if jax.tree_util.keystr(path).endswith(("_scales']", "_mins']"))])
    matmul_params = (weight_bytes + fp8_bytes + 3 * codes_bytes - scale_bytes - expert_bytes + active * expert_bytes) // 2 - embed * (
        1 if config.tie_word_embeddings else 2)
    useful_matmul = 2 * matmul_params * num_tokens + 2 * embed * num_logits
    useful = useful_matmul + 4 * kv_layers * config.num_heads * config.head_dim * num_tokens * case.context
    if config.is_hybrid:  # the delta rule per token and linear layer: decay, S^T k, rank-1 update, S^T q
        useful += (4 * 2 * (config.num_layers - kv_layers) * config.linear_num_value_heads * config.linear_key_head_dim
                   * config.linear_value_head_dim * num_tokens)
    memory = out.compiled.memory_analysis()
    pool_bytes = _device_bytes(runner.kv_pages)
    copies = [launch for launch in acc.launches if launch.kind == "copy"]
    collectives = [launch for launch in acc.launches if launch.kind == "collective"]
    payload = sum(c.count * c.bytes_written for c in collectives)
    nvlink = sum(c.count * bus_bytes(c.detail, c.bytes_written, case.tp) for c in collectives)
    # The compiled chip's floors, and the other chip's from the same program (its bandwidths only).
    chip_floors = {chip: floors(acc.hbm_bytes, ideal, acc.num_launches, target, nvlink) for chip, target in TARGETS.items()}
    target = TARGETS[case.chip]
    return {
        **dataclasses.asdict(case), "num_layers": config.num_layers, "expert_bytes": expert_bytes,
        "launches": acc.num_launches, "kernels_launched": acc.num_kernels, "copies": acc.num_copies,
        "copy_bytes": acc.copy_bytes, "launches_per_layer": round(acc.num_launches / config.num_layers, 2),
        "hbm_bytes": acc.hbm_bytes, "ideal_bytes": int(ideal), "bytes_to_ideal": round(acc.hbm_bytes / ideal, 4),
        "floor_ms": chip_floors[case.chip]["bytes_floor_ms"], "ideal_floor_ms": chip_floors[case.chip]["ideal_floor_ms"],
        "launch_floor_ms": chip_floors[case.chip]["launch_floor_ms"], "floors": chip_floors,
        "collectives": sum(c.count for c in collectives), "collective_payload_bytes": payload,
        "nvlink_bus_bytes": int(nvlink), "weight_bytes": weight_bytes, "lora_bytes": lora_bytes,
        "model_weight_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(runner.served_params)),
        "executed_flops": acc.flops, "useful_flops": useful,
        # XLA's dots against the useful matmul FLOPs (attention's run inside the kernels, which the HLO
        # does not size): > 1 would mean padded rows or logits computed for tokens that sample nothing.
        "useful_matmul_flops": useful_matmul, "matmul_flops_to_useful": round(acc.flops / useful_matmul, 4),
        "compute_floor_ms": round(useful / target.bf16_dense_flops * 1e3, 4),
        "temp_bytes": int(memory.temp_size_in_bytes), "kv_pool_bytes": pool_bytes, "state_ideal_bytes": state_bytes,
        "kv_aliased": int(memory.alias_size_in_bytes) >= pool_bytes,
        "by_kind": acc.by_kind(), "largest_copies": sorted(
            ({"name": c.name, "count": c.count, "bytes": c.hbm_bytes, "detail": c.detail} for c in copies),
            key=lambda c: -c["bytes"])[:6],
        "largest_kernels": sorted(  # where the bytes go
            ({"name": k.name, "count": k.count, "bytes": k.hbm_bytes, "flops": k.count * k.flops, "detail": k.detail}
             for k in acc.launches if k.kind in ("kernel", "gemm")), key=lambda k: -k["bytes"])[:8],
        "pallas": [{"name": p.name, "count": p.count, "bytes": p.hbm_bytes, "detail": p.detail}
                   for p in acc.pallas_kernels()],
        "lower_s": round(out.lower_seconds, 2), "compile_s": round(out.compile_seconds, 2),
        "warnings": acc.warnings[:5],
    }
