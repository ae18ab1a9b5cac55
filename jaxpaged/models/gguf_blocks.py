"""GGUF weights kept as their block codes (`quantization="gguf"`), dequantized layer by layer in the step.

GGUF's legacy block types store a weight row in blocks of 32 values, one scale (float16) per block:

    Q4_0   18 bytes: d, 16 bytes of nibbles q in 0..15         w = d * (q - 8)
    Q4_1   20 bytes: d, m, 16 bytes of nibbles q in 0..15      w = d * q + m
    Q8_0   34 bytes: d, 32 int8 q in -128..127                 w = d * q

(nibbles: byte j holds value j in its low four bits and value j + 16 in its high four). All three are
read into one layout, one code per value, so every kind dequantizes the same way:

    codes uint8 [rows, cols]   scales float32 [rows, cols / 32]   mins float32 [rows, cols / 32]
    w = scales * codes + mins  (Q4_0: codes q, mins -8d; Q8_0: codes q + 128, mins -128d)

In the parameter tree a weight whose codes all fit in four bits (every layer Q4_0 / Q4_1) keeps them
packed again, two per byte in GGUF's order (`pack_nibbles`); the others keep one byte per code.

Each w equals gguf's own float32 dequantization: scales * codes has at most 11 + 8 significant
bits, so the product is exact and the sum is rounded once, as gguf's `d * q + m` is (fused
multiply-add or not); for Q4_0 and Q8_0 the sum, d * (q - 8) or d * q, is exact itself. Bit for bit
too, but for the sign of a zero: gguf's d * 0 is -0.0 where d is negative, here +0.0. The
step reads 0.75 bytes per weight for 4-bit kinds (1.25 for Q8_0) instead of 4 in a float32 engine
(2 in bfloat16); a CPU decode step of a few rows is bound by reading its weights
(benchmarks/peers/README.md). Measured on the CPU only. On XLA:CPU
every step multiplies the codes with a C++ kernel (`linear`, ops/cpu/gguf_matmul.cc) that dequantizes
them to these same floats as it reads them; elsewhere, and where it cannot be built, XLA dequantizes the
layer's weights, then multiplies.

In the parameter tree a kept weight `name` is three leaves beside where `name` would be:
`name_codes` [in/32, 32, out] (packed: [in/32, 16, out]), `name_scales` and `name_mins` [in/32, out]
(plus the leading layers axis), `in` and `out` being the float weight's first axis and the product of the others. Dense
layer projections are kept (`PROJECTIONS`), and a tied embedding, as the 16-column panels of its LM
head (`panel_leaves`: `embedding_codes` [vocab/16, hidden, 16], one byte per code; `embedding_scales`
and `embedding_mins` [vocab/16, hidden/32, 16]) that the CPU kernel ops/cpu/gguf_panels.cc reads as
contiguous runs. An untied embedding or output head, MoE experts and other block types (K quants) stay
float, and so does a projection any layer of which is not kept.

The CPU runner serves the projections as panels too (`to_panels`: `name_panels`, `name_panel_scales`,
`name_panel_mins`, the same bytes reordered, read by gguf_panels.cc); the tree above stays the canonical
one (`from_panels`), which `llm.params` returns and `update_params` takes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.ops import fp8_block_matmul, fp8_matmul, gguf_panels, w4a16_matmul
from jaxpaged.ops.gguf_matmul import unpacked  # one code per byte from either layout (used in the step)

BLOCK = 32
PANEL = gguf_panels.PANEL
Q8_1 = "q8_1"  # in a runner's kernels: codes multiply Q8_1 activations (gguf_activations="q8_1")
SUFFIXES = ("_codes", "_scales", "_mins")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A tied embedding kept as codes (`panel_leaves`): the token lookup and the LM head read them.
EMBEDDING = "embedding"
# A projection as the runner serves it on the CPU (`to_panels`): its codes, scales and minimums in
# 16-column panels, read by ops/cpu/gguf_panels.cc.
PANEL_SUFFIXES = ("_panels", "_panel_scales", "_panel_mins")
KEPT_LEAVES = frozenset([*(name + suffix for name in (*PROJECTIONS, EMBEDDING) for suffix in SUFFIXES),
                         *(name + suffix for name in PROJECTIONS for suffix in PANEL_SUFFIXES)])
# FP8 projections of a quantized Hugging Face checkpoint (models/hf_quant.py): float8 values, float32 scales.
FP8_LEAVES = frozenset(name + suffix for name in PROJECTIONS for suffix in fp8_matmul.SUFFIXES)
# Whether runners with the gguf_panels kernel serve the projections as panels (else GGUF's layout, read
# by gguf_matmul). Read when an engine is built: benchmarks compare the two in one process.
SERVE_PANELS = True
# gguf.GGMLQuantizationType values: Q4_0, Q4_1, Q8_0.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
KEPT_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """One GGUF matrix as codes: uint8 [rows, cols], float32 scales and mins [rows, cols / 32]."""

    codes: np.ndarray
    scales: np.ndarray
    mins: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        rows, cols = self.codes.shape
        blocks = self.codes.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
        return (self.scales[..., None] * blocks + self.mins[..., None]).reshape(rows, cols)

    def map_rows(self, fn) -> "BlockCodes":
        """The same matrix with `fn` (a reordering of rows) applied to codes, scales and mins."""
        return BlockCodes(fn(self.codes), fn(self.scales), fn(self.mins))


def unpack(data: np.ndarray, qtype: int, shape: tuple[int, int]) -> BlockCodes:
    """Raw GGUF rows (uint8 [rows, bytes_per_row]) of a Q4_0 / Q4_1 / Q8_0 matrix `shape` as codes."""
    rows, cols = shape
    blocks = np.asarray(data).reshape(rows, cols // BLOCK, -1)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q8_0:
        q = blocks[..., 2:34].copy().view(np.int8)
        codes, mins = (q.astype(np.int16) + 128).astype(np.uint8), d * np.float32(-128)
    elif qtype in (Q4_0, Q4_1):
        start = 2 if qtype == Q4_0 else 4
        nibbles = blocks[..., start:start + BLOCK // 2]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        mins = d * np.float32(-8) if qtype == Q4_0 else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        raise ValueError(f"GGUF block type {qtype} is not one of {sorted(KEPT_TYPES.values())}")
    return BlockCodes(np.ascontiguousarray(codes.reshape(rows, cols)), np.ascontiguousarray(d),
                      np.ascontiguousarray(mins))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes [..., 32, out], all below 16, as two per byte [..., 16, out]: byte j of a block holds k row j
    in its low four bits and row j + 16 in its high four (GGUF's own Q4 order)."""
    if codes.shape[-2] != BLOCK or codes.max(initial=0) > 15:
        raise ValueError(f"pack_nibbles: codes [..., {BLOCK}, out] below 16; got {codes.shape}, max {codes.max(initial=0)}")
    half = BLOCK // 2
    return np.ascontiguousarray(codes[..., :half, :] | (codes[..., half:, :] << 4), dtype=np.uint8)


def is_packed(codes) -> bool:
    """Whether a codes leaf ([..., rows, out]) holds two 4-bit codes per byte."""
    return codes.shape[-2] == BLOCK // 2


def stacked_leaves(name: str, layers: list[BlockCodes]) -> dict[str, np.ndarray]:
    """The three leaves of weight `name` over all layers, from HF-layout (out, in) codes: packed two per
    byte when every code fits in four bits (Q4_0, Q4_1)."""
    out, cols = layers[0].shape
    codes = np.stack([m.codes.T.reshape(cols // BLOCK, BLOCK, out) for m in layers])
    if codes.max(initial=0) < 16:
        codes = pack_nibbles(codes)
    return {name + "_codes": codes, name + "_scales": np.stack([m.scales.T for m in layers]),
            name + "_mins": np.stack([m.mins.T for m in layers])}


def panel_leaves(embedding: BlockCodes) -> dict[str, np.ndarray]:
    """The three leaves of a tied embedding E [vocab, hidden] kept as codes, in 16-column panels of
    its LM head W = E^T (ops/gguf_panels.py): codes [vocab/16, hidden, 16], scales and mins
    [vocab/16, hidden/32, 16]; one byte per code."""
    vocab, hidden = embedding.shape

    def panels(part: np.ndarray) -> np.ndarray:  # [vocab, cols] -> [vocab/16, cols, 16]
        return np.ascontiguousarray(part.reshape(vocab // PANEL, PANEL, part.shape[1]).transpose(0, 2, 1))

    return {EMBEDDING + "_codes": panels(embedding.codes), EMBEDDING + "_scales": panels(embedding.scales),
            EMBEDDING + "_mins": panels(embedding.mins)}


def keeps_embedding(embedding, tied: bool) -> bool:
    """Whether a model's embedding stays codes (`panel_leaves`): a kept block type, tied to the LM head
    (an untied head's embedding only looks tokens up), a vocabulary of whole panels."""
    return isinstance(embedding, BlockCodes) and tied and embedding.shape[0] % PANEL == 0


def _panels_of(codes, scales, mins):
    """One stacked weight's leaves from GGUF's layout ([L, K/32, 32 or 16, N], [L, K/32, N]) to panels
    ([L, N/16, K or K/2, 16], [L, N/16, K/32, 16]): the same bytes, reordered."""
    (num_layers, kb, rows, n), xp = codes.shape, jnp if isinstance(codes, jax.Array) else np
    codes = xp.reshape(codes, (num_layers, kb, rows, n // PANEL, PANEL)).transpose(0, 3, 1, 2, 4)
    codes = xp.reshape(codes, (num_layers, n // PANEL, kb * rows, PANEL))
    part = lambda a: xp.reshape(a, (num_layers, kb, n // PANEL, PANEL)).transpose(0, 2, 1, 3)
    return tuple(xp.ascontiguousarray(a) if xp is np else a for a in (codes, part(scales), part(mins)))


def _blocks_of(codes, scales, mins):
    """The inverse of `_panels_of`."""
    (num_layers, panels, _, _), kb = codes.shape, scales.shape[2]
    xp = jnp if isinstance(codes, jax.Array) else np
    codes = xp.reshape(codes, (num_layers, panels, kb, -1, PANEL)).transpose(0, 2, 3, 1, 4)
    codes = xp.reshape(codes, (num_layers, kb, codes.shape[2], panels * PANEL))
    part = lambda a: xp.reshape(a.transpose(0, 2, 1, 3), (num_layers, kb, panels * PANEL))
    return tuple(xp.ascontiguousarray(a) if xp is np else a for a in (codes, part(scales), part(mins)))


def _convert_projections(params, from_suffixes, to_suffixes, convert, delete: bool):
    """`params` (a canonical tree: stacked layers) with every projection's three leaves renamed and
    converted; `delete`: device leaves converted are deleted (the runner's own copies)."""
    if params is None or not isinstance(params.get("params", {}).get("layers"), dict):
        return params
    layers, changed = dict(params["params"]["layers"]), False
    for module, leaves in layers.items():
        names = [name for name in PROJECTIONS if isinstance(leaves, dict) and name + from_suffixes[0] in leaves
                 and not (to_suffixes == PANEL_SUFFIXES and leaves[name + "_codes"].shape[-1] % PANEL)]
        if not names:  # (columns not whole panels: kept in GGUF's layout, multiplied by XLA)
            continue
        leaves, changed = dict(leaves), True
        for name in names:
            old = [leaves.pop(name + suffix) for suffix in from_suffixes]
            leaves.update(zip((name + suffix for suffix in to_suffixes), convert(*old)))
            if delete:
                for leaf in old:
                    if isinstance(leaf, jax.Array):
                        leaf.delete()
        layers[module] = leaves
    if not changed:  # the same tree: a float engine's `llm.params` stays its own object
        return params
    return {**params, "params": {**params["params"], "layers": layers}}


def to_panels(params, *, delete: bool = False):
    """The projections of a canonical tree as panels (`PANEL_SUFFIXES`), as the CPU runner serves them."""
    return _convert_projections(params, SUFFIXES, PANEL_SUFFIXES, _panels_of, delete)


def from_panels(params):
    """The canonical tree (GGUF's layout, `SUFFIXES`) of one served as panels: new arrays."""
    return _convert_projections(params, PANEL_SUFFIXES, SUFFIXES, _blocks_of, False)


def is_kept_leaf(name: str) -> bool:
    return name in KEPT_LEAVES or name in FP8_LEAVES


def leaf_name(path) -> str:
    """The last key of a jax key path: the parameter's own name ("" for a bare array)."""
    return str(getattr(path[-1], "key", "")) if path else ""


def leaf_dtype(path, dtype):
    """The dtype the parameter leaf at `path` is stored in: codes uint8, FP8 weights float8_e4m3fn, scales
    and mins float32, every other leaf `dtype`."""
    name = leaf_name(path)
    if not is_kept_leaf(name):
        return dtype
    if name.endswith("_fp8"):
        return np.dtype(jnp.float8_e4m3fn)
    return np.dtype(np.uint8) if name.endswith("_codes") else np.dtype(np.float32)


def kept_projections(params) -> list[str]:
    """The projections of `params` held as codes, e.g. ["q_proj", ..., "down_proj"]."""
    names = {leaf_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    return [name for name in PROJECTIONS if name + "_codes" in names]


def has_kept_weights(params) -> bool:
    return bool(kept_projections(params))


def has_packed_codes(params) -> bool:
    """Whether a layer projection of `params` keeps 4-bit codes packed two per byte (`is_packed`)."""
    return any(leaf_name(path).endswith("_codes") and leaf_name(path) != EMBEDDING + "_codes" and is_packed(leaf)
               for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0])


def has_block_fp8(params) -> bool:
    """Whether a projection of `params` is FP8 with block scales (`name_fp8_scale` [..., G > 1, out])."""
    return any(leaf_name(path).endswith("_fp8_scale") and x.shape[-2] > 1
               for path, x in jax.tree_util.tree_flatten_with_path(params)[0])


REFUSED_UPDATE = ("this engine keeps the GGUF file's block codes (quantization='gguf', a .gguf model's default as in "
                  "vLLM), so new weights must come in that same tree (`llm.params`: *_codes, *_scales, *_mins); to "
                  "load float weights (a trainer's, Hugging Face names) build the LLM with quantization='dequantize'")


def linear(module, name: str, x, shape: tuple[int, ...], equation: str, dtype, init, *, matrix: bool = False,
           kernels: frozenset = frozenset(), stack: dict | None = None, layer=0, min_rows: int = 1):
    """`jnp.einsum(equation, x, w)` for the weight `name` of `shape` (in first; `matrix`: taken as
    [prod(shape[:-1]), shape[-1]]).

    `kernels` (static; the runner sets it on the CPU, models/llama.py CausalLM.matmul_kernels): the C++
    kernels that multiply layer projections reading their weights where they lie, "gguf_matmul" a
    weight kept as codes (ops/cpu/gguf_matmul.cc), "dense_matmul" a float32 weight
    (ops/cpu/dense_matmul.cc). The weight comes from `stack` (the module's leaves over all layers, taken
    at `layer`: inside the scan over layers a slice of the module's own leaves would be a copy) or,
    without a stack, the module's own leaves (one layer). x must then be [T, in] float32 (any T: the
    kernels are the faster, or as fast, from 1 to 512 rows, benchmarks/peers/README.md, ninth pass);
    otherwise XLA's path below runs.

    With Q8_1 in `kernels` (gguf_activations="q8_1"), a weight kept as codes multiplies x as its Q8_1
    blocks hold it: the gguf_panels_q8 kernel quantizes x itself; every other path is handed
    `dequantized_q8_1(x)` (the same products up to float32 rounding).

    `min_rows` (static; CausalLM.min_dot_rows): XLA's dot is given at least this many rows of x [T, ...],
    zero rows appended and the product sliced back. On a GPU a one-row dot with K * (N + 1) under 10M
    (every projection of a small model) is strength-reduced into multiply + reduce; where the multiply
    cannot join the reduce (its vector is silu(gate) * up, or a norm) it writes a weight-sized product
    and reads it back (3x the weight's bytes); two rows make it a GEMM (jaxpaged/static_profile).

    A weight kept as FP8 (`name_fp8`, models/hf_quant.py) is multiplied by ops/fp8_matmul.py: W8A16, or
    W8A8 with `fp8_matmul.W8A8` in `kernels` (ModelConfig.fp8_activations "fp8"); block scales by
    ops/fp8_block_matmul.py's kernel where `fp8_block_matmul.NAME` is in `kernels` (a GPU) and it
    serves the call (`use_kernel`: up to MAX_ROWS rows, dynamic activations).

    With `w4a16_matmul.NAME` in `kernels` (the runner sets it on a CUDA GPU), this layer's packed 4-bit
    codes multiply x in the Pallas kernel of ops/w4a16_matmul.py, which reads them as stored; more than
    its MAX_ROWS rows (a prefill: bound by compute) take XLA's path, the weight dequantized first."""
    own = stack is None
    if not module.is_initializing() and module.has_variable("params", name + "_fp8"):
        weight, scale, input_scale = (module.get_variable("params", name + s) if module.has_variable("params", name + s)
                                      else None for s in fp8_matmul.SUFFIXES)
        rows = math.prod(shape[:-1]) if matrix else shape[0]
        flat = x.reshape(-1, rows)
        if flat.shape[0] < min_rows:
            flat = jnp.pad(flat, [(0, min_rows - flat.shape[0]), (0, 0)])
        activations = "fp8" if fp8_matmul.W8A8 in kernels else "float"
        if fp8_block_matmul.NAME in kernels and fp8_block_matmul.use_kernel(flat, scale, input_scale):
            y = fp8_block_matmul.block_matmul(flat, weight, scale, activations=activations, dtype=dtype)
        else:
            y = fp8_matmul.fp8_matmul(flat, weight, scale, input_scale, dtype=dtype, activations=activations)
        out_dims = (shape[-1],) if matrix else shape[1:]
        return y[: math.prod(x.shape[:-1])].reshape(x.shape[:-1] + out_dims)
    if w4a16_matmul.NAME in kernels and not module.is_initializing() and module.has_variable("params", name + "_codes"):
        # packed 4-bit codes on a GPU: the Pallas kernel reads them as stored (ops/w4a16_matmul.py)
        codes = module.get_variable("params", name + "_codes")  # this layer's [in/32, 16, out]
        rows = math.prod(shape[:-1]) if matrix else shape[0]
        flat = x.reshape(-1, rows)
        if x.dtype in (jnp.bfloat16, jnp.float32) and w4a16_matmul.supports(flat.shape, codes.shape):
            scales, mins = (module.get_variable("params", name + s) for s in SUFFIXES[1:])
            out_dims = (shape[-1],) if matrix else shape[1:]
            y = w4a16_matmul.w4a16_matmul(flat, codes, scales, mins)
            return y.astype(dtype).reshape(x.shape[:-1] + out_dims)
        # (one byte a code, more than MAX_ROWS rows, out-features not a multiple of 16: XLA's path below)

    def leaf(key):  # [L, ...] from the stack, or this layer's own leaf as [1, ...]
        if not own:
            return stack.get(key)
        return module.get_variable("params", key)[None] if module.has_variable("params", key) else None

    panels = not module.is_initializing() and leaf(name + "_panels") is not None
    q8_kernel = panels and gguf_panels.Q8_NAME in kernels and x.ndim == 2 and x.dtype == jnp.float32
    kept = not module.is_initializing() and any(  # codes: the module's own leaves (in the scan) or the stack's
        module.has_variable("params", name + s) or (stack is not None and name + s in stack)
        for s in ("_panels", "_codes"))
    if Q8_1 in kernels and kept and not q8_kernel:  # every path but the q8 kernel takes x as Q8_1 holds it
        x = _as_q8_1(x, math.prod(shape[:-1]) if matrix else shape[0])
    if kernels and not module.is_initializing() and x.ndim == 2 and x.dtype == jnp.float32:
        out_shape = x.shape[:-1] + ((shape[-1],) if matrix else shape[1:])
        rows = math.prod(shape[:-1]) if matrix else shape[0]  # the weight as [rows, cols]
        cols = math.prod(shape) // rows
        at = 0 if own else layer
        if gguf_panels.NAME in kernels and panels:  # served as panels (to_panels)
            codes, scales, mins = (leaf(name + s) for s in PANEL_SUFFIXES)
            multiply = gguf_panels.gguf_panels_q8 if q8_kernel else gguf_panels.gguf_panels
            return multiply(x, codes, scales, mins, at).reshape(out_shape).astype(dtype)
        if "gguf_matmul" in kernels and leaf(name + "_codes") is not None and cols % 16 == 0:
            from jaxpaged.ops.gguf_matmul import gguf_matmul

            codes, scales, mins = (leaf(name + s) for s in SUFFIXES)
            return gguf_matmul(x, codes, scales, mins, at).reshape(out_shape).astype(dtype)
        w = leaf(name)
        if ("dense_matmul" in kernels and w is not None and w.dtype == jnp.float32 and w.shape[1:] == tuple(shape)
                and cols % 16 == 0):
            from jaxpaged.ops.dense_matmul import dense_matmul

            return dense_matmul(x, w.reshape(w.shape[0], rows, cols), at).reshape(out_shape).astype(dtype)
    w = linear_weight(module, name, shape, dtype, init)
    w = w.reshape(-1, shape[-1]) if matrix else w
    if x.shape[0] < min_rows:
        padded = jnp.pad(x, [(0, min_rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        return jnp.einsum(equation, padded, w)[: x.shape[0]]
    return jnp.einsum(equation, x, w)


def _as_q8_1(x, features: int):
    """x as Q8_1 blocks of its last axes (the weight's `features` in values, flattened) hold it, in x's dtype."""
    flat = x.reshape(-1, features).astype(jnp.float32)
    return gguf_panels.dequantized_q8_1(flat).astype(x.dtype).reshape(x.shape)


def kept_panels(module) -> tuple | None:
    """The tied embedding's (codes, scales, mins) panels where the tree keeps it as codes, else None."""
    if module.is_initializing() or not module.has_variable("params", EMBEDDING + "_codes"):
        return None
    return tuple(module.get_variable("params", EMBEDDING + suffix) for suffix in SUFFIXES)


def panels_head(x, panels: tuple, kernels: frozenset):
    """float32 logits x @ E^T [S, vocab] from the embedding's panels: the C++ kernel where the runner
    enabled it (ops/cpu/gguf_panels.cc; float32 x), else XLA dequantizes E (float32 math, then x's
    dtype, as a float engine of that dtype holds it), then multiplies."""
    if gguf_panels.NAME in kernels and x.ndim == 2 and x.dtype == jnp.float32:
        return (gguf_panels.gguf_panels_q8 if gguf_panels.Q8_NAME in kernels else gguf_panels.gguf_panels)(x, *panels)
    if Q8_1 in kernels:
        x = _as_q8_1(x, x.shape[-1])
    return jnp.einsum("SD,DV->SV", x, gguf_panels.weight(*panels).astype(x.dtype), preferred_element_type=jnp.float32)


def cpu_matmul_kernels(params, platform: str, tp, model_config) -> frozenset:
    """The C++ kernels a runner multiplies its layer projections with (`linear`): "gguf_panels" where the
    tree keeps codes (projections the runner serves as panels, `to_panels`, and a tied embedding kept as
    codes, `panels_head`), "gguf_matmul" for codes in GGUF's layout (SERVE_PANELS off), "dense_matmul"
    for float32 weights; on XLA:CPU, one device (a custom call has no sharding rule: no `tp`, the
    runner's TensorParallel, or a one-device mesh, as a data-parallel replica's), float32 activations,
    each kernel built and not switched off (JAXPAGED_CPU_KERNELS). On a CUDA GPU (one device), packed
    4-bit codes: "w4a16_matmul" (ops/w4a16_matmul.py, a Pallas kernel).
    With model_config.gguf_activations "q8_1": Q8_1 (on every platform; `linear`), and "gguf_panels_q8"
    (the panels against Q8_1 activations) where gguf_panels runs. On a GPU, one device, FP8 weights with
    block scales: "fp8_block_matmul" (ops/fp8_block_matmul.py's Pallas GEMM, where JAX has Triton)."""
    codes = has_kept_weights(params) or EMBEDDING + "_codes" in params.get("params", params)
    q8 = frozenset([Q8_1]) if model_config.gguf_activations == "q8_1" else frozenset()
    if model_config.fp8_activations == "fp8":  # FP8 weights multiply FP8 activations (on every platform)
        q8 = q8 | {fp8_matmul.W8A8}
    if platform in ("cuda", "gpu") and (tp is None or tp.mesh.size == 1) and has_packed_codes(params):
        q8 = q8 | {w4a16_matmul.NAME}  # packed 4-bit codes on a GPU: the Pallas kernel (a custom call: one device)
    if platform in ("gpu", "cuda") and (tp is None or tp.mesh.size == 1) and fp8_block_matmul.available() \
            and has_block_fp8(params):  # block-scaled FP8 through the Pallas GEMM (it has no sharding rule)
        q8 = q8 | {fp8_block_matmul.NAME}
    if platform != "cpu" or (tp is not None and tp.mesh.size > 1) or jnp.dtype(model_config.dtype) != jnp.float32:
        return q8
    from jaxpaged.ops import dense_matmul, gguf_matmul

    panels = codes and gguf_panels.enabled()
    return q8 | frozenset(([gguf_matmul.NAME] if has_kept_weights(params) and gguf_matmul.enabled() else [])
                          + ([gguf_panels.NAME] if panels else [])
                          + ([gguf_panels.Q8_NAME] if q8 and panels and gguf_panels.q8_enabled() else [])
                          + ([dense_matmul.NAME] if dense_matmul.enabled() else []))


def stack_of(layers_params: dict, module: str, kernels: frozenset) -> dict:
    """The leaves of `module` ("attn", "mlp") in the stacked `layers` params that `kernels` multiply, for
    `linear`'s stack: kept codes (gguf_matmul), float32 projections (dense_matmul)."""
    def served(name: str, leaf) -> bool:
        return ((("gguf_matmul" in kernels or gguf_panels.NAME in kernels) and is_kept_leaf(name))
                or ("dense_matmul" in kernels and name in PROJECTIONS and leaf.dtype == jnp.float32))

    return {name: leaf for name, leaf in layers_params.get(module, {}).items() if served(name, leaf)}


def linear_weight(module, name: str, shape: tuple[int, ...], dtype, init):
    """The float weight `name` of `shape` (in first) in a flax module: the param itself, or its
    codes dequantized (float32 math, then cast to `dtype`) when the tree keeps it as codes."""
    if not module.is_initializing() and module.has_variable("params", name + "_panels"):  # served as panels
        panels = (module.get_variable("params", name + suffix) for suffix in PANEL_SUFFIXES)
        with jax.named_scope("gguf_dequantize"):
            return gguf_panels.weight(*panels).reshape(shape).astype(dtype)
    if not module.is_initializing() and module.has_variable("params", name + "_codes"):
        codes = unpacked(module.get_variable("params", name + "_codes"))  # [in/32, 32, out]
        scales = module.get_variable("params", name + "_scales")[:, None, :]
        mins = module.get_variable("params", name + "_mins")[:, None, :]
        with jax.named_scope("gguf_dequantize"):  # names the fusion in profiles
            return (scales * codes.astype(jnp.float32) + mins).reshape(shape).astype(dtype)
    return module.param(name, init, shape, dtype)
