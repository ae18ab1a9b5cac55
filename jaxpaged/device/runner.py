"""The device side of a step: scheduler output -> padded `StepInput` -> one jitted, donated step.

    host (numpy)                                   device (one jitted function per bucket)
    SchedulerOutput --prepare_step_input--> StepInput --ModelRunner.execute--> logits [num_seqs, vocab]
                      pack_step_input: one int32 array,   kv_pages donated in, updated buffer out
                      one transfer                        placeholder tokens gathered from the
                                                          previous step's sampled tokens

Shapes come from a small fixed list of buckets, so after `warmup()` no step compiles again. Decode-
only steps have their own buckets (1, 2, 4, ... max_num_seqs sequences of one token) and their own
programs: `StepInput.decode_only` is static pytree metadata, so it selects a compiled program, and
there the model calls the backend's decode kernel (if it has one) instead of the ragged one.
"""

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.ops.kv_quant import QuantizedKV, check_kv_cache_dtype, tree_bytes, zeros_kv_cache
from jaxpaged.device.step_input import StepInput, default_buckets, default_decode_buckets, pack_step_input, prepare_step_input
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gguf_blocks import BLOCK, cpu_matmul_kernels
from jaxpaged.models.llama import AttentionFn, CausalLM
from jaxpaged.models.qwen3_next import Qwen3NextLM, zeros_linear_state
from jaxpaged.sample.logprobs import split_prompt_logprobs, with_every_token
from jaxpaged.models.moe import apply_returning_routed_experts, experts_for
from jaxpaged.device.layer_params import canonical_layout, own_copy, serving_layout
from jaxpaged.device.batch_invariant import check_batch_invariant
from jaxpaged.device.kv_centres import calibrate_kv_centres
from jaxpaged.device.sharding import TensorParallel
from jaxpaged.device.lora_slots import LoRASlots
from jaxpaged.models.lora import target_dims

# StepInput is plain numpy on the host; as a pytree it crosses jax.jit as one argument. Its arrays
# are leaves; `decode_only` is metadata, part of the tree structure, hence static under jit.
_STEP_META_FIELDS = ("decode_only",)
jax.tree_util.register_dataclass(StepInput, meta_fields=list(_STEP_META_FIELDS), data_fields=[
    f.name for f in dataclasses.fields(StepInput) if f.name not in _STEP_META_FIELDS])
__all__ = ["ModelRunner", "StepInput", "default_buckets", "pack_step_input", "prepare_step_input"]


def enable_compilation_cache() -> str:
    """Turns on JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxpaged/xla).

    Every program is kept, however fast it compiled: JAX's default keeps only those that took 1 s
    or more, and most step programs of a small model take less, so a warm start compiled them all
    again. A threshold the user set (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, or jax.config) is
    left as it is.
    """
    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.expanduser("~/.cache/jaxpaged/xla")
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
            and jax.config.jax_persistent_cache_min_compile_time_secs == 1.0):  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return jax.config.jax_compilation_cache_dir


_MAX_COMPILE_THREADS = 8


def compile_in_parallel(jobs, num_threads: int | None = None) -> None:
    """Runs `jobs` on a thread pool: callables that each compile a program, by lowering it (nothing
    runs) or by running it on inputs nothing else reads or donates.

    XLA's compiler releases the GIL, so programs compile side by side (tracing and lowering, in
    Python, still take turns); the first error is raised. `num_threads` defaults to the CPUs this
    process may run on, at most `_MAX_COMPILE_THREADS` (each compile holds its program's HLO and
    LLVM state in host memory); one thread under several processes. What warm-up calls afterwards finds compiled, in memory.
    """
    jobs = list(jobs)
    num_threads = num_threads or min(len(os.sched_getaffinity(0)), _MAX_COMPILE_THREADS)
    # Several processes (jax.distributed) run each program in lockstep: a job that runs one (a sampler's
    # on zeros) must start in the same order everywhere, so they run one after another in list order.
    if num_threads <= 1 or len(jobs) <= 1 or jax.process_count() > 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=min(num_threads, len(jobs)), thread_name_prefix="jaxpaged-compile") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def _compile_traced(trace, *args, **kwargs) -> None:
    trace(*args, **kwargs).lower().compile()


def _compile_lowered(fn, *args, **kwargs) -> None:
    fn.lower(*args, **kwargs).compile()  # donations are not consumed: nothing runs


def apply_page_copies(
    kv_pages: Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | QuantizedKV,
    src: Int[Array, "num_copies"],
    dst: Int[Array, "num_copies"],
) -> Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | QuantizedKV:
    """Copies page `src[i]` to page `dst[i]` in every layer, K and V, all pairs at once (reads
    see the buffer before any write). Padding pairs have dst = num_pages: out of range, dropped.
    A quantized cache's scales move with their pages (every leaf has page axis 3)."""
    return jax.tree.map(lambda leaf: leaf.at[:, :, :, dst].set(leaf[:, :, :, src], mode="drop"), kv_pages)


def codes_layout_hint(path: str, got: tuple, want: tuple) -> str:
    """What to do when the codes leaf at `path` (a key string) comes as `got` for `want`, the other layout
    (`ModelRunner.update_params` checks new weights' shapes); "" for any other leaf or difference."""
    got, want = tuple(got), tuple(want)
    same_otherwise = len(got) == len(want) >= 2 and got[:-2] + got[-1:] == want[:-2] + want[-1:]
    if "_codes" not in path or not same_otherwise or {got[-2], want[-2]} != {BLOCK, BLOCK // 2}:
        return ""
    if want[-2] == BLOCK // 2:
        return ("; this engine keeps 4-bit GGUF codes packed two per byte ([..., 16, out]): pack one-byte codes "
                "with jaxpaged.models.gguf_blocks.pack_nibbles")
    return "; this engine keeps these GGUF codes one per byte ([..., 32, out]): unpack them with gguf_blocks.unpacked"


def check_hybrid_runner(num_state_slots: int, *, tp, kv_cache_dtype: str, return_routed_experts: bool,
                        batch_invariant: bool) -> None:
    """ValueError naming what a hybrid (linear-attention) model's runner does not implement."""
    refusals = [
        (num_state_slots < 1, f"{num_state_slots=}", "a hybrid model needs >= 1 state slot (max_num_seqs)"),
        (tp is not None, "a mesh (tensor parallelism)", "run it on one device"),
        (kv_cache_dtype != "auto", f"{kv_cache_dtype=}", "use 'auto'"),
        (return_routed_experts, "return_routed_experts", "leave it off"),
        (batch_invariant, "batch_invariant", "leave it off"),
    ]
    for refused, name, fix in refusals:
        if refused:
            raise ValueError(f"{name} is not supported for hybrid linear-attention models (Qwen3-Next): {fix}")


class ModelRunner:
    """Owns the parameters and the KV page buffer; runs one jitted step per `execute` call.

    The step is `(params, kv_pages, step_input) -> (logits, kv_pages)` with `kv_pages` donated:
    the buffer is updated in place and `self.kv_pages` always names the live one. Parameters are an
    argument (not a constant), so `update_params` swaps weights without recompiling.

    `mesh`: a `jax.sharding.Mesh` with a `tp` axis (`jaxpaged.device.sharding.make_mesh`) splits the model
    over its devices (tensor parallelism); None runs on the default device.

    Abstract params (every leaf a `jax.ShapeDtypeStruct` carrying a sharding) make a compile-only
    runner: nothing is allocated, the KV buffer is abstract too, `trace_step` traces the engine's
    real step for that sharding's devices (e.g. an H100 from a CPU host: jaxpaged/static_profile/), and
    `execute` refuses. With a `mesh` (of such devices) the abstract params are laid out as tensor
    parallelism places real ones (`TensorParallel.abstract_params`).

    `per_layer_weights`: one weight buffer per layer, layers unrolled (device/layer_params.py: no weight
    copies in the step); None: on a GPU, under a mesh too (on the CPU it compiled ~5x longer, ran no faster),
    and for an attention with effects off a GPU (Mosaic GPU interpret mode: flax's scan refuses it).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        params,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_fn: AttentionFn | None = None,
        buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
        mesh=None,
        kv_cache_dtype: str = "auto",
        per_layer_weights: bool | None = None,
        return_routed_experts: bool = False,  # MoE: execute returns (its result, ids [T, L, k]): engine/routed_experts.py
        batch_invariant: bool = False,  # every token's arithmetic independent of the step (device/batch_invariant.py)
        lora: tuple[int, int] | None = None,  # (max_loras, max_lora_rank): adapter slots (device/lora_slots.py)
        num_state_slots: int = 0,  # hybrid models (Qwen3-Next): recurrent-state slots 1..this (planner/state_pool.py)
    ):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2: page 0 is the padding page")
        check_kv_cache_dtype(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"{max_num_seqs=} must be <= {max_num_batched_tokens=}: each sequence has >= 1 token")
        # Tensor parallelism (jaxpaged/device/sharding.py): parameters and the KV buffer split over `mesh`,
        # attention run per device on its own heads. self.config is the model as the devices see
        # it (KV heads replicated when the mesh is wider than num_kv_heads).
        model_config = model_config.for_max_model_len(max_model_len)  # LongRoPE: long factors past the original
        one_attention_path = getattr(attention_fn, "one_path", False)  # read before any tp wrapping
        self.tp = TensorParallel.create(mesh, model_config) if mesh is not None else None
        if self.tp is not None:
            model_config = self.tp.config
            attention_fn = self.tp.shard_attention(attention_fn or reference_paged_attention)
        self.config, self.return_routed_experts = model_config, return_routed_experts
        self.num_pages, self.page_size = num_pages, page_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.buckets = tuple(sorted(buckets or default_buckets(max_num_batched_tokens)))
        if self.buckets[-1] < max_num_batched_tokens:
            raise ValueError(f"largest bucket {self.buckets[-1]} < {max_num_batched_tokens=}; add a bucket")
        enable_compilation_cache()

        # Shapes as the caller passes them (under tensor parallelism the placed KV projections may be
        # wider: replicated KV heads); update_params checks new weights against these.
        self._param_shapes = {
            jax.tree_util.keystr(k): tuple(np.shape(x)) for k, x in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        c = model_config
        kv_shape = (c.num_kv_layers, 2, c.num_kv_heads, num_pages, page_size, c.head_dim)
        leaves = jax.tree.leaves(params)
        self.abstract = bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        self.hybrid, self.num_state_slots = c.is_hybrid, num_state_slots
        if self.hybrid:
            check_hybrid_runner(num_state_slots, tp=self.tp, kv_cache_dtype=kv_cache_dtype,
                                return_routed_experts=return_routed_experts, batch_invariant=batch_invariant)
            per_layer_weights = False  # its layers are unrolled already (models/qwen3_next.py)
        platform = next(iter(leaves[0].sharding.device_set)).platform if self.abstract else jax.devices()[0].platform
        # MoE: on a CUDA GPU the grouped matmul is a Pallas kernel (models/moe.py experts_for); under a mesh,
        # experts split over the tp axis (expert parallelism, each device's share inside shard_map).
        self.expert_fn = experts_for(platform)
        expert_fn = self.tp.shard_experts(self.expert_fn) if self.tp is not None else self.expert_fn
        # ops/cpu/gguf_matmul.cc, dense_matmul.cc
        self.matmul_kernels = frozenset() if self.hybrid else cpu_matmul_kernels(params, platform, self.tp, model_config)
        if batch_invariant:
            check_batch_invariant(model_config, platform=platform, matmul_kernels=self.matmul_kernels,
                                  one_attention_path=one_attention_path, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                                  sharded=self.tp is not None and self.tp.mesh.size > 1)
        self.batch_invariant = batch_invariant
        model = functools.partial(CausalLM, model_config, attention_fn or reference_paged_attention, expert_fn=expert_fn,
                                  vocab_major_head=platform == "cpu" and self.tp is None,  # llama.tied_lm_head
                                  matmul_kernels=self.matmul_kernels, batch_invariant=batch_invariant,
                                  min_dot_rows=1 if platform == "cpu" else 2)  # llama.CausalLM.min_dot_rows
        if self.hybrid:  # the step's state is (kv_pages, linear_state), each row's slot an input
            model = functools.partial(Qwen3NextLM, model_config, attention_fn or reference_paged_attention,
                                      expert_fn=expert_fn)
        self.model, self.decode_model = model(), model(decode_only=True)
        # An attention with effects where it runs (Mosaic GPU interpret mode's io callbacks, off a GPU) cannot
        # sit in flax's layer scan (flax 0.12.12's nn.scan refuses a body with effects; 0.12.8 took it): unrolled.
        effects = getattr(attention_fn, "effects_when_interpreted", False) and platform == "cpu"
        self.per_layer_weights = ((platform != "cpu" or effects) and not return_routed_experts  # ids: the scan's
                                  ) if per_layer_weights is None else per_layer_weights
        # Decode-only steps: 1 (2 on a GPU, where a one-row step pads its projections' dots to 2 rows
        # anyway: CausalLM.min_dot_rows), 2, 4, ... max_num_seqs sequences; `()`: decode steps take the token buckets.
        self.decode_buckets = tuple(sorted(default_decode_buckets(max_num_seqs, smallest=1 if platform == "cpu" else 2)
                                           if decode_buckets is None else decode_buckets))
        if any(d < 1 or d > max_num_seqs for d in self.decode_buckets):
            raise ValueError(f"decode buckets {self.decode_buckets} must lie in [1, {max_num_seqs=}]")
        # "auto": one float array; "int8" / "float8_e4m3fn": QuantizedKV(pages, scales), every leaf
        # with page axis 3 (jaxpaged/ops/kv_quant.py). Either way it is the donated step state.
        # Every device input committed (jit keys its cache on it): warm-up's programs are then serving's.
        self.placement = self.tp.replicated if self.tp is not None else jax.devices()[0]
        self.zeros_on_device = functools.partial(jnp.zeros, device=self.placement)
        if self.abstract:  # compile-only: shapes and the params' sharding (under a mesh: tp's layout), no memory
            self._abstract_sharding = leaves[0].sharding if self.tp is None else self.tp.replicated
            self._serve(params if self.tp is None else self.tp.abstract_params(params))
            kv = jax.eval_shape(lambda: zeros_kv_cache(kv_shape, c.dtype, kv_cache_dtype))
            self.kv_pages = jax.tree.map(self._abstract, kv) if self.tp is None else jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.tp.kv_pages_sharding(x.shape)), kv)
            step_shardings = copy_shardings = {}
            if self.tp is not None:  # as the real branch below
                kv_sharding = jax.tree.map(lambda leaf: leaf.sharding, self.kv_pages)
                step_shardings, copy_shardings = dict(out_shardings=(self.tp.replicated, kv_sharding)), dict(
                    out_shardings=kv_sharding)
        elif self.tp is None:
            self._serve(self._to_device(params))
            self.kv_pages = zeros_kv_cache(kv_shape, c.dtype, kv_cache_dtype, zeros=self.zeros_on_device)
            step_shardings = copy_shardings = {}
        else:
            self._serve(self._to_device(params))
            self.kv_pages = zeros_kv_cache(kv_shape, c.dtype, kv_cache_dtype, zeros=self.tp.zeros_kv_pages)
            kv_sharding = jax.tree.map(lambda leaf: self.tp.kv_pages_sharding(leaf.shape), self.kv_pages)
            step_shardings = dict(out_shardings=(self.tp.replicated, kv_sharding))  # logits replicated
            copy_shardings = dict(out_shardings=kv_sharding)
        # Multi-LoRA: the adapter slots' stacks are an argument of every step (their shapes fixed by
        # max_loras and max_lora_rank: loading adapters never recompiles); None: no adapters. The
        # compile-only runner's stacks are abstract, on its devices.
        if lora is not None and self.tp is not None:
            raise ValueError("LoRA adapters run on one device (no tensor-parallel mesh) yet")
        if lora is not None and self.hybrid:
            raise ValueError("LoRA adapters are not supported on hybrid linear-attention models (Qwen3-Next) yet; "
                             "leave enable_lora off")
        self.lora = None if lora is None else LoRASlots(
            target_dims(c), num_layers=c.num_layers, max_loras=lora[0], max_lora_rank=lora[1], dtype=c.dtype,
            placement=self.placement, abstract=self._abstract if self.abstract else None,
            per_layer=self.per_layer_weights)  # unrolled layers read their own slot buffers
        # Hybrid models: (conv, recurrent) state per slot, slot 0 the padding slot; donated with kv_pages.
        self.linear_state = None if not self.hybrid else jax.tree.map(  # the compile-only runner's: abstract
            self._abstract, jax.eval_shape(lambda: zeros_linear_state(c, num_state_slots + 1))) if self.abstract else \
            zeros_linear_state(c, num_state_slots + 1, self.zeros_on_device)
        centres = calibrate_kv_centres(c, self.served_params, kv_cache_dtype, abstract=self.abstract)  # device/kv_centres.py
        place = (self._abstract if self.tp is None else lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=self.tp.kv_pages_sharding(x.shape))) if self.abstract else \
            self.tp and (lambda x: jax.device_put(x, self.tp.kv_pages_sharding(x.shape)))
        self.kv_centres = place(centres) if place and centres is not None else centres
        # update_params checks new trees against this (self.params is None after sleep(level=2): device/sleep.py).
        self._params_tree = jax.tree.structure(params)
        # Copy-on-write copies run in their own small donated function, padded to max_num_seqs
        # pairs (the scheduler copies at most one page per sequence per step): most steps have
        # no copies and pay nothing, and StepInput stays the DESIGN.md contract.
        self.max_num_copies = max_num_seqs
        self.num_compiles, self.num_copy_compiles = 0, 0  # traces of the step / page-copy functions
        # The previous step's sampled tokens, as the sampler returns them padded to this many rows:
        # a decode whose input token is still on the device reads it from there (asynchronous stepping).
        self.num_prev_token_rows = max_num_seqs
        self._no_prev_tokens = self._abstract(jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32)) if self.abstract else self.zeros_on_device(max_num_seqs, jnp.int32)
        if self.per_layer_weights and platform != "cpu":
            # Unrolled, XLA's rematerialisation sees each layer's in-place KV write as a new pool: off.
            step_shardings = dict(step_shardings, compiler_options={"xla_gpu_memory_limit_slop_factor": 1000})
        self._step = jax.jit(
            self._step_fn, donate_argnames=("kv_pages",), static_argnames=("layout", "decode_only"), **step_shardings
        )
        self._copy = jax.jit(self._copy_fn, donate_argnames=("kv_pages",), **copy_shardings)
        self._copy_state = jax.jit(self._copy_state_fn, donate_argnames=("linear_state",))
        # Host transfers (swap, the prefix cache's host tier) move pages in fixed batches of this many,
        # padded, so no call compiles: one sequence's pages fit one batch.
        self.max_num_transfer_pages = self.pages_per_seq
        self.num_transfer_compiles = 0
        self._gather = jax.jit(self._gather_fn)
        self._scatter = jax.jit(self._scatter_fn, donate_argnames=("kv_pages",), **copy_shardings)
        # A hybrid model's swapped states move in batches of max_num_seqs slots (every running sequence at most).
        self._gather_state = jax.jit(self._gather_state_fn)
        self._scatter_state = jax.jit(self._scatter_state_fn, donate_argnames=("linear_state",))

    @property
    def params(self):
        """The canonical (stacked) parameter tree: where the runner serves another layout (one buffer per
        layer, GGUF panels: `served_params`, device/layer_params.py) this is a new copy."""
        return canonical_layout(self.served_params)

    def _serve(self, params) -> None:
        """Keeps the runner's own copy `params` (canonical) as the step reads it (device/layer_params.py)."""
        self.served_params = serving_layout(params, per_layer=self.per_layer_weights, kernels=self.matmul_kernels)

    def _abstract(self, x) -> jax.ShapeDtypeStruct:  # x's shape and dtype on the compile-only runner's devices
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._abstract_sharding)

    def _to_device(self, params):  # the engine's own float copy in the model dtype (layer_params.own_copy)
        return own_copy(params, jnp.dtype(self.config.dtype), self.tp)

    def _step_fn(self, params, kv_pages, packed: Int[Array, "num_packed"], prev_tokens: Int[Array, "num_rows"],
                 kv_centres, lora_stacks=None, *, layout, decode_only: bool = False):
        # kv_centres: device/kv_centres.py (None: "auto"); lora_stacks: device/lora_slots.py (None: no adapters)
        self.num_compiles += 1  # runs only while tracing
        fields, offset = {}, 0
        for name, shape in layout:  # static slices of the one packed transfer
            size = math.prod(shape)
            fields[name] = packed[offset : offset + size].reshape(shape)
            offset += size
        step_input = StepInput(**fields, decode_only=decode_only)
        token_ids = step_input.token_ids
        if step_input.prev_token_rows is not None:
            rows = step_input.prev_token_rows
            token_ids = jnp.where(rows >= 0, prev_tokens[jnp.maximum(rows, 0)], token_ids)
        model = self.decode_model if decode_only else self.model  # static: a compiled program each
        targets = step_input.prompt_logprob_targets  # prompt logprobs: logits at every token too
        # A hybrid model's kv_pages is the pair (kv_pages, linear_state) and its rows' slots come last;
        # other models take the adapter slots and stacks there (None: no adapters).
        slots = (step_input.state_slots,) if self.hybrid else (
            None if lora_stacks is None else (step_input.lora_slots, lora_stacks),)
        (logits, kv_pages), routed = apply_returning_routed_experts(
            model, self.return_routed_experts, params, kv_pages, token_ids, step_input.positions,
            step_input.slot_mapping, step_input.block_tables, step_input.seq_lens, step_input.query_start_loc,
            with_every_token(step_input.logits_indices, targets), kv_centres, *slots,
        )
        logits = split_prompt_logprobs(logits, step_input.logits_indices.shape[0], targets)
        return (logits if routed is None else (logits, routed)), kv_pages

    def _copy_state_fn(self, linear_state, src, dst):
        self.num_copy_compiles += 1  # runs only while tracing
        return jax.tree.map(lambda leaf: leaf.at[:, dst].set(leaf[:, src], mode="drop"), linear_state)

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Hybrid models: copies state slot `src -> dst` in every linear layer (a fork's child starts from its
        parent's state, a prefix hit from a snapshot, a snapshot from a sequence's slot), in list order;
        call before the step that runs them. Batches of max_num_seqs pairs, a new batch wherever a copy
        reads or writes a slot an earlier copy of the batch writes (a batch reads all, then writes all)."""
        batches, batch, written = [], [], set()
        for src, dst in copies:
            if len(batch) == self.max_num_copies or src in written or dst in written:
                batches.append(batch)
                batch, written = [], set()
            batch.append((src, dst))
            written.add(dst)
        for pairs in batches + [batch] if batch else batches:
            chunk = np.asarray(pairs, np.int32).reshape(-1, 2)
            src = np.zeros(self.max_num_copies, np.int32)
            dst = np.full(self.max_num_copies, self.linear_state[0].shape[1], np.int32)  # out of range: dropped
            src[: len(chunk)], dst[: len(chunk)] = chunk[:, 0], chunk[:, 1]
            self.linear_state = self._copy_state(self.linear_state, src, dst)

    def _gather_state_fn(self, linear_state, slots):
        self.num_transfer_compiles += 1  # runs only while tracing
        return jax.tree.map(lambda leaf: leaf[:, slots], linear_state)

    def _scatter_state_fn(self, linear_state, states, slots):
        self.num_transfer_compiles += 1  # runs only while tracing
        return jax.tree.map(lambda leaf, new: leaf.at[:, slots].set(new, mode="drop"), linear_state, states)

    def gather_states(self, slots: Sequence[int]):
        """Hybrid models: state slots `slots` (at most max_num_seqs) of every linear layer, on the device, slot
        axis 1 padded to max_num_seqs (padding reads slot 0). Dispatched, not awaited: ordered after every
        step already issued, before every later one."""
        ids = np.zeros(self.max_num_copies, np.int32)
        ids[: len(slots)] = slots
        return self._gather_state(self.linear_state, ids)

    def scatter_states(self, states, slots: Sequence[int]) -> None:
        """Writes host `states` (a pair like `linear_state`, slot axis 1 of size max_num_seqs) into state slots
        `slots`; rows past `len(slots)` are dropped."""
        ids = np.full(self.max_num_copies, self.linear_state[0].shape[1], np.int32)  # out of range: dropped
        ids[: len(slots)] = slots
        self.linear_state = self._scatter_state(self.linear_state, states, ids)

    def _kv_state(self):  # the step's donated state: kv_pages, or (kv_pages, linear_state) for a hybrid model
        return (self.kv_pages, self.linear_state) if self.hybrid else self.kv_pages

    def _copy_fn(self, kv_pages, src, dst):
        self.num_copy_compiles += 1  # runs only while tracing
        return apply_page_copies(kv_pages, src, dst)

    def _gather_fn(self, kv_pages, page_ids):
        self.num_transfer_compiles += 1  # runs only while tracing
        return jax.tree.map(lambda leaf: leaf[:, :, :, page_ids], kv_pages)

    def _scatter_fn(self, kv_pages, pages, page_ids):
        self.num_transfer_compiles += 1  # runs only while tracing
        return jax.tree.map(lambda leaf, new: leaf.at[:, :, :, page_ids].set(new, mode="drop"), kv_pages, pages)

    def gather_pages(self, page_ids: Sequence[int]):
        """Pages `page_ids` (at most `max_num_transfer_pages`) of every KV leaf, on the device, page
        axis 3 padded to `max_num_transfer_pages` (padding reads page 0). Dispatched, not awaited:
        ordered after every step already issued on the buffer, before every later one."""
        ids = np.zeros(self.max_num_transfer_pages, np.int32)
        ids[: len(page_ids)] = page_ids
        if self.tp is not None:
            ids = self._place_replicated(ids)
        return self._gather(self.kv_pages, ids)

    def scatter_pages(self, pages, page_ids: Sequence[int]) -> None:
        """Writes host `pages` (a pytree like `kv_pages`, page axis 3 of size `max_num_transfer_pages`)
        into pages `page_ids` of the buffer; rows past `len(page_ids)` are dropped."""
        ids = np.full(self.max_num_transfer_pages, self.num_pages, np.int32)  # out of range: dropped
        ids[: len(page_ids)] = page_ids
        if self.tp is not None:
            ids = self._place_replicated(ids)
        self.kv_pages = self._scatter(self.kv_pages, pages, ids)

    def prepare(self, scheduler_output, block_table_rows=None, **logits_rows) -> StepInput:
        """`prepare_step_input` with this runner's page pool and buckets (`logits_rows`:
        num_logits, max_num_logits for a speculative verification step; seq_lora_slots with adapters)."""
        return prepare_step_input(
            scheduler_output, page_size=self.page_size, num_pages=self.num_pages,
            pages_per_seq=self.pages_per_seq, max_num_seqs=self.max_num_seqs, buckets=self.buckets,
            block_table_rows=block_table_rows, state_slots=self.hybrid,
            decode_buckets=self.decode_buckets, **logits_rows,
        )

    def execute(self, step_input: StepInput, prev_tokens=None) -> (
            Float[Array, "num_logits vocab_size"] | tuple):  # a tuple with prompt logprobs / routed experts
        """Runs one step; returns float32 logits for every (padded) sequence row of the bucket (with
        `step_input.prompt_logprob_targets`: (logits, sample/logprobs.token_logprobs of every token)).

        `prev_tokens` (int32 [num_prev_token_rows], on device) are the previous step's sampled tokens,
        read where `step_input.prev_token_rows` says; None when no input token is a placeholder.
        """
        if self.abstract:
            raise ValueError("this runner is compile-only (abstract params): use trace_step, or give real params")
        packed, layout = pack_step_input(step_input)
        prev_tokens = jax.device_put(self._no_prev_tokens if prev_tokens is None else prev_tokens, self.placement)
        if self.tp is not None:  # the same host arrays on every device (and process) of the mesh
            packed = self._place_replicated(packed)
        logits, kv_state = self._step(
            self.served_params, self._kv_state(), packed, prev_tokens, self.kv_centres, self._lora_stacks(step_input),
            layout=layout, decode_only=step_input.decode_only)
        if self.hybrid:
            self.kv_pages, self.linear_state = kv_state
        else:
            self.kv_pages = kv_state
        return logits

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies whole pages (all layers, K and V) `src -> dst`; call before the step that needs them."""
        for i in range(0, len(copies), self.max_num_copies):
            self.kv_pages = self._copy(self.kv_pages, *self._copy_indices(copies[i : i + self.max_num_copies]))

    def _copy_indices(self, copies: Sequence[tuple[int, int]]):
        """(src, dst) of one page-copy call, padded to max_num_copies with dropped copies."""
        chunk = np.asarray(copies, np.int32).reshape(-1, 2)
        src = np.zeros(self.max_num_copies, np.int32)
        dst = np.full(self.max_num_copies, self.num_pages, np.int32)  # out of range: dropped
        src[: len(chunk)], dst[: len(chunk)] = chunk[:, 0], chunk[:, 1]
        return self._place_replicated((src, dst)) if self.tp is not None else (src, dst)

    def run(self, scheduler_output) -> Float[Array, "num_seqs vocab_size"]:
        """Copy-on-write copies, then the step: the whole device side of one `SchedulerOutput`."""
        if getattr(scheduler_output, "state_copies", None):
            self.copy_states(scheduler_output.state_copies)
        self.copy_pages(scheduler_output.copies)
        return self.execute(self.prepare(scheduler_output))

    def _place_replicated(self, tree):
        return jax.device_put(tree, self.tp.replicated)

    def zeros_logits(self, num_rows: int) -> Float[Array, "num_rows vocab_size"]:
        """Zero logits placed (committed) as `execute` returns them (the engine warms its sampler up on these)."""
        return self.zeros_on_device((num_rows, self.config.vocab_size), jnp.float32)

    @property
    def num_step_programs(self) -> int:
        """Compiled step programs after `warmup`: two per token bucket (+ prompt logprobs), one per decode bucket."""
        return 2 * len(self.buckets) + len(self.decode_buckets)

    def dummy_step_input(self, bucket: int, *, decode_only: bool = False) -> StepInput:
        """An all-padding step of `bucket` tokens (`decode_only`: `bucket` sequences); writes and reads nothing."""
        num_seqs = bucket if decode_only else min(bucket, self.max_num_seqs)
        zeros = np.zeros(bucket, np.int32)
        return StepInput(
            token_ids=zeros, positions=zeros,
            slot_mapping=np.full(bucket, self.num_pages * self.page_size, np.int32),
            block_tables=np.zeros((num_seqs, self.pages_per_seq), np.int32),
            seq_lens=np.zeros(num_seqs, np.int32), query_start_loc=np.zeros(num_seqs + 1, np.int32),
            logits_indices=np.zeros(num_seqs, np.int32), prev_token_rows=np.full(bucket, -1, np.int32),
            lora_slots=None if self.lora is None else zeros,
            state_slots=np.zeros(num_seqs, np.int32) if self.hybrid else None, decode_only=decode_only,
        )

    def warmup_step_inputs(self) -> list[StepInput]:
        """One all-padding input per step program: every bucket, every decode bucket, and the
        prompt-logprobs program of each bucket (decode buckets never need one)."""
        return ([self.dummy_step_input(bucket) for bucket in self.buckets]
                + [self.dummy_step_input(bucket, decode_only=True) for bucket in self.decode_buckets]
                + [dataclasses.replace(self.dummy_step_input(bucket), prompt_logprob_targets=np.full(bucket, -1, np.int32))
                   for bucket in self.buckets])

    def compile_jobs(self) -> list:
        """One callable per step program that compiles it and runs nothing (`trace_step`), for
        `compile_in_parallel` before `warmup`: the step programs' ahead-of-time compiles land in the
        cache `execute` reads, so warmup's own calls then compile none of them."""
        jobs = [functools.partial(_compile_traced, self.trace_step, step_input) for step_input in self.warmup_step_inputs()]
        return [*jobs, functools.partial(_compile_lowered, self._copy, self.kv_pages, *self._copy_indices([]))]

    def warmup(self, *, host_transfers: bool = False) -> None:
        """Compiles the step for every bucket and decode bucket, the page copy, and (when the engine
        has host pages: swap, host tier) the host transfers, so serving never compiles."""
        for step_input in self.warmup_step_inputs():
            jax.block_until_ready(self.execute(step_input))
        self.copy_pages([(0, self.num_pages)])  # a dropped copy: compiles, changes nothing
        if self.lora is not None:
            self.lora.warmup()  # the adapter slot write
        if self.hybrid:
            self.copy_states([(0, 0)])  # the padding slot onto itself: compiles, changes nothing
        if host_transfers:  # one program each way
            jax.block_until_ready(self.gather_pages([]))
            empty = jax.tree.map(  # host pages shaped as the gather returns them
                lambda leaf: np.zeros(leaf.shape[:3] + (self.max_num_transfer_pages,) + leaf.shape[4:], leaf.dtype),
                self.kv_pages,
            )
            self.scatter_pages(empty, [])  # all rows dropped: changes nothing
            if self.hybrid:  # swapped states
                states = jax.block_until_ready(self.gather_states([]))
                self.scatter_states(jax.tree.map(np.asarray, states), [])

    def update_params(self, params) -> None:
        """Swaps in a copy of new weights with the same tree and shapes; the compiled step is reused.

        Float leaves are cast to the model dtype and copied (the caller may delete or donate its
        arrays afterwards); a non-float leaf, a missing or extra leaf, or a shape that differs
        raises ValueError naming the leaf, and the current weights stay.
        """
        keystr = jax.tree_util.keystr
        have = self._param_shapes
        got = {keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        missing, extra = sorted(have.keys() - got.keys()), sorted(got.keys() - have.keys())
        if missing or extra:
            raise ValueError(
                f"new params do not have this model's parameter tree: missing {missing[:5]}, unexpected {extra[:5]}; "
                "pass params with the same structure as `params` of this engine (load a new LLM for another model)"
            )
        for path, shape in have.items():
            got_shape = tuple(getattr(got[path], "shape", ()))
            if got_shape != tuple(shape):  # (GGUF codes in the other layout: say how to convert)
                raise ValueError(f"param {path} has shape {got_shape}, expected {tuple(shape)}{codes_layout_hint(path, got_shape, shape)}")
        new = self._to_device(params)
        if jax.tree.structure(new) != self._params_tree:  # e.g. a dict where a FrozenDict was
            raise ValueError(f"new params have tree {jax.tree.structure(new)}, expected {self._params_tree}")
        self._serve(new)

    def kv_cache_bytes(self) -> int:
        return tree_bytes(self.kv_pages)

    def trace_step(self, step_input: StepInput, prev_tokens=None):
        """`jax.jit(...).trace` of the step for `step_input`, for tests and tools that inspect or lower
        the compiled program (`.jaxpr`, `.lower(lowering_platforms=("cuda",))`); runs nothing."""
        packed, layout = pack_step_input(step_input)
        prev_tokens = self._no_prev_tokens if prev_tokens is None else prev_tokens
        if self.abstract:
            packed = self._abstract(packed)
        if self.tp is not None:  # placed as execute places them
            packed, prev_tokens = self._place_replicated((packed, prev_tokens))
        return self._step.trace(
            self.served_params, self._kv_state(), packed, prev_tokens, self.kv_centres, self._lora_stacks(step_input),
            layout=layout, decode_only=step_input.decode_only)

    def _lora_stacks(self, step_input: StepInput):
        """The adapter stacks a step reads (None without adapters); a step of an adapter engine must say
        each token's slot."""
        if self.lora is None:
            return None
        if step_input.lora_slots is None:
            raise ValueError("this runner serves LoRA adapters: every StepInput needs lora_slots (0: the base model)")
        return self.lora.stacks

    def step_temp_bytes(self, bucket: int | None = None) -> int:
        """Scratch bytes of the compiled step for `bucket` tokens (default: the largest bucket).

        XLA's own figure (`memory_analysis().temp_size_in_bytes`): activations, logits, kernel
        outputs. The KV buffer is donated and aliased, the parameters are arguments: neither counts.
        Compiles the step (once per bucket and pool size; the persistent cache keeps it).
        """
        step_input = self.dummy_step_input(self.buckets[-1] if bucket is None else bucket)
        compiled = self.trace_step(step_input).lower().compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)
