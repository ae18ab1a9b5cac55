"""Quantized Hugging Face checkpoints (a config.json `quantization_config`) read as packed weights.

    quant_method         weight tensors (HF names; W [out, in])                           kept as
    fp8                  weight float8_e4m3fn, weight_scale_inv (or weight_scale):        Fp8Matrix
                         per tensor [], per channel [out, 1], blocks [out/bo, in/bi]
                         (weight_block_size [bo, bi]); input_scale (activation_scheme static)
    compressed-tensors   float-quantized: weight float8_e4m3fn, weight_scale, input_scale  Fp8Matrix
                         pack-quantized: weight_packed int32 (4 or 8 bits per value along   BlockCodes
                         in, stored q + 2^(b-1)), weight_scale [out, in/g], weight_zero_point
                         (asymmetric: packed along out); int-quantized: weight int8
    awq (GEMM)           qweight int32 [in, out/8], qzeros int32 [in/g, out/8] (AWQ's nibble   BlockCodes
                         order 0 2 4 6 1 3 5 7), scales [in/g, out]
    gptq (4 bits)        qweight int32 [in/8, out], qzeros int32 [in/g, out/8] (v1: stored      BlockCodes
                         z - 1), scales [in/g, out], g_idx [in]

Integer formats are w = scale * (q - z) over groups of g input features. That is GGUF's block layout
(models/gguf_blocks.py: codes, scales and mins per 32 values of a row) with each group's scale repeated
over its g / 32 blocks and mins = -scale * z, so they are served by the GGUF codes path: packed two per
byte (4 bits) or one (8 bits), multiplied on the CPU by the C++ kernels that dequantize as they read.
FP8 weights stay float8 (`fp8_leaves`, multiplied by ops/fp8_matmul.py).

What is not kept packed is dequantized here to float32 and loads as an ordinary weight, with the same
values: a group size that is not a multiple of 32, GPTQ's desc_act=True with an act-order g_idx, a
Phi-3's fused projections, MoE experts, a
quantized embedding or LM head. Every other scheme is refused by name (`check_quantization_config`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
import math
from collections.abc import Mapping

import numpy as np

from jaxpaged.models.gguf_blocks import BLOCK, BlockCodes
from jaxpaged.ops.fp8_matmul import SUFFIXES as FP8_SUFFIXES

logger = logging.getLogger("jaxpaged")

METHODS = ("fp8", "compressed-tensors", "awq", "gptq")
# compressed-tensors formats read (float-quantized: FP8; the others: integers).
CT_FORMATS = ("float-quantized", "pack-quantized", "int-quantized", "naive-quantized")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config quant_method={method!r}: {what} is not supported; jaxpaged reads "
                      "fp8 (per-tensor, per-channel, block), compressed-tensors (FP8, W4A16 / W8A16), AWQ (GEMM) "
                      "and GPTQ (4-bit) checkpoints; use the model's unquantized checkpoint, or a .gguf of it")


def method_of(quantization) -> str | None:
    if not quantization:
        return None
    return quantization.get("quant_method") if isinstance(quantization, Mapping) else getattr(quantization, "quant_method", None)


def check_quantization_config(quantization: Any) -> str:
    """The quant_method of a `quantization_config` jaxpaged serves; ValueError naming the first field it
    does not (a method, format, bit width, activation scheme, act-order)."""
    if not isinstance(quantization, Mapping) and not hasattr(quantization, "to_dict"):
        raise ValueError(f"quantization_config={quantization!r}: expected a mapping with a quant_method (the "
                         "checkpoint's config.json is malformed)")
    method = method_of(quantization)
    if not isinstance(quantization, Mapping):
        quantization = quantization.to_dict()
    if method not in METHODS:
        raise ValueError(f"quantization_config with quant_method={method!r} is not supported: jaxpaged loads "
                         f"unquantized Hugging Face checkpoints, {METHODS} checkpoints and GGUF files; use the "
                         "model's unquantized checkpoint, or a .gguf of it")
    get = quantization.get
    if method == "fp8":
        if get("fmt", "e4m3") != "e4m3":
            raise _refuse(method, f"fmt={get('fmt')!r} (only 'e4m3')")
        if get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _refuse(method, f"activation_scheme={get('activation_scheme')!r}")
        block = get("weight_block_size")
        if block is not None and (len(block) != 2 or get("activation_scheme", "dynamic") != "dynamic"):
            raise _refuse(method, f"weight_block_size={block} with activation_scheme={get('activation_scheme')!r} "
                                  "(blocks take dynamic activation scales)")
    elif method == "compressed-tensors":
        _check_compressed_tensors(quantization)
    elif method == "awq":
        version = str(get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(method, f"version={get('version')!r} (only the GEMM layout)")
        if get("bits", get("w_bit", 4)) != 4 or not get("zero_point", True):
            raise _refuse(method, f"bits={get('bits', get('w_bit'))}, zero_point={get('zero_point')} (only 4 bits with zero points)")
    elif method == "gptq":
        if get("bits", 4) != 4:
            raise _refuse(method, f"bits={get('bits')} (only 4)")
        if get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise _refuse(method, f"checkpoint_format={get('checkpoint_format')!r}")
    return method


def _check_compressed_tensors(quantization: Mapping) -> None:
    method = "compressed-tensors"
    for name, group in (quantization.get("config_groups") or {}).items():
        fmt = group.get("format") or quantization.get("format")
        if fmt not in CT_FORMATS:
            raise _refuse(method, f"config_groups[{name!r}] format={fmt!r}")
        weights = group.get("weights") or {}
        kind, bits = weights.get("type"), weights.get("num_bits")
        strategy = weights.get("strategy")
        if kind == "float":
            if bits != 8 or strategy not in ("tensor", "channel", "block"):
                raise _refuse(method, f"float weights num_bits={bits} strategy={strategy!r} (FP8 per tensor, "
                                      "channel or block)")
        elif kind == "int":
            if bits not in (4, 8) or strategy not in ("group", "channel"):
                raise _refuse(method, f"int weights num_bits={bits} strategy={strategy!r} (4 or 8 bits per group "
                                      "or channel)")
        else:
            raise _refuse(method, f"weights type={kind!r}")
        if weights.get("dynamic"):
            raise _refuse(method, "dynamic weight scales")
        acts = group.get("input_activations")
        if acts is not None and not (kind == "float" and acts.get("type") == "float" and acts.get("num_bits") == 8
                                     and (acts.get("dynamic") in (True, "local") or acts.get("strategy") == "tensor")):
            raise _refuse(method, f"input_activations {acts} with {kind} weights (FP8 W8A8 only)")
        if acts is not None and strategy == "block" and not acts.get("dynamic"):
            raise _refuse(method, "static input activations with block weights")
        if group.get("output_activations") is not None:
            raise _refuse(method, "output_activations")
    if quantization.get("kv_cache_scheme") is not None:
        raise _refuse(method, "kv_cache_scheme (use EngineConfig kv_cache_dtype)")
    if quantization.get("sparsity_config") or quantization.get("transform_config"):
        raise _refuse(method, "sparsity_config / transform_config")


@dataclasses.dataclass(frozen=True)
class Fp8Matrix:
    """One FP8 weight in HF's layout: float8_e4m3fn [out, in], float32 scale [out / bo, in / bi] (blocks
    bo x bi, the last ones partial; per tensor [1, 1], per channel [out, 1]) and, for a static
    activation scheme, the activations' float32 scale."""

    weight: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]  # (rows, cols) of weight per scale; the last block of each axis may be partial
    input_scale: float | None = None

    def __post_init__(self):
        (out, cols), (bo, bi) = self.weight.shape, self.block
        if self.scale.shape != (-(-out // bo), -(-cols // bi)):
            raise ValueError(f"an FP8 weight [{out}, {cols}] in blocks {self.block} needs scales "
                             f"[{-(-out // bo)}, {-(-cols // bi)}], not {list(self.scale.shape)}: the checkpoint "
                             "does not match its quantization_config")

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def expanded_scale(self) -> np.ndarray:
        """float32 [out, in]: each value's scale."""
        (out, cols), (bo, bi) = self.weight.shape, self.block
        return np.repeat(np.repeat(self.scale, bo, axis=0)[:out], bi, axis=1)[:, :cols]

    def dequantize(self) -> np.ndarray:
        return self.weight.astype(np.float32) * self.expanded_scale()


def fp8_leaves(name: str, layers: list[Fp8Matrix]) -> dict[str, np.ndarray]:
    """The leaves of FP8 weight `name` over all layers, in first (ops/fp8_matmul.py's layout):
    `name_fp8` float8 [L, in, out], `name_fp8_scale` float32 [L, G, out] (G = 1, or in / bi for blocks
    bo x bi; in-features not whole blocks: in / gcd(bi, in), each block's scale repeated) and,
    with a static activation scheme, `name_input_scale` float32 [L]."""
    (out, cols), (bo, bi) = layers[0].shape, layers[0].block

    def scale_of(m: Fp8Matrix) -> np.ndarray:  # [G, out]: each column block's scale over its columns
        columns = np.repeat(m.scale.T, bo, axis=1)[:, :out].astype(np.float32)
        if cols % bi == 0:
            return columns
        # in-features not whole blocks (320 in blocks of 128): groups of gcd(bi, in) rows, each its block's scale
        group = math.gcd(bi, cols)
        return np.repeat(columns, bi // group, axis=0)[: cols // group]

    weight, scale, input_scale = (name + suffix for suffix in FP8_SUFFIXES)
    leaves = {weight: np.stack([np.ascontiguousarray(m.weight.T) for m in layers]),
              scale: np.stack([scale_of(m) for m in layers])}
    if layers[0].input_scale is not None:
        leaves[input_scale] = np.asarray([m.input_scale for m in layers], np.float32)
    return leaves


def quantized_leaves(params) -> list[str]:
    """The names of `params`' leaves that hold packed weights (GGUF-layout codes, FP8 values), in tree order."""
    import jax

    names = [str(getattr(path[-1], "key", "")) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [n for n in names if n.endswith(("_codes", "_panels", "_fp8"))]


def group_codes(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> BlockCodes | np.ndarray:
    """w = scales * (codes - zeros) over groups of in-features, HF layout: codes [out, in] (unsigned),
    scales and zeros [out, in / g]. As GGUF block codes when g and in are multiples of 32, else the
    float32 weight (the same values)."""
    out, cols = codes.shape
    group = cols // scales.shape[1]
    scales = scales.astype(np.float32)
    mins = -scales * zeros.astype(np.float32)
    if group % BLOCK or cols % BLOCK or group * scales.shape[1] != cols:
        logger.warning("a quantized weight [%d, %d] with groups of %d in-features is dequantized to float at load "
                       "(GGUF's codes path needs groups of a multiple of 32)", out, cols, group)
        return np.repeat(scales, group, axis=1) * codes.astype(np.float32) + np.repeat(mins, group, axis=1)
    repeat = group // BLOCK
    return BlockCodes(np.ascontiguousarray(codes.astype(np.uint8)), np.repeat(scales, repeat, axis=1),
                      np.repeat(mins, repeat, axis=1))


def unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> unsigned values along `axis`: value i of a word at bits [i * bits, (i + 1) * bits)."""
    per_word = 32 // bits
    words = np.moveaxis(np.asarray(packed).astype(np.int64) & 0xFFFFFFFF, axis, -1)
    shifts = np.arange(per_word, dtype=np.int64) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return np.moveaxis(values.reshape(*words.shape[:-1], -1), -1, axis)


def quantized_state_dict(quantization, state_dict: Mapping) -> dict:
    """`state_dict` with each quantized linear's tensors replaced by one `weight` entry: an Fp8Matrix,
    BlockCodes or float32 array (module docstring). Tensors of no quantized module pass as they are."""
    method = check_quantization_config(quantization)
    if not isinstance(quantization, Mapping):
        quantization = quantization.to_dict()
    out = dict(state_dict)
    readers = {"fp8": _fp8_module, "compressed-tensors": _ct_module, "awq": _awq_module, "gptq": _gptq_module}
    marker = {"fp8": (".weight_scale_inv", ".weight_scale"), "compressed-tensors": (".weight_scale",),
              "awq": (".qweight",), "gptq": (".qweight",)}[method]
    prefixes = sorted({name[: -len(m)] for name in state_dict for m in marker if name.endswith(m)})
    for prefix in prefixes:
        tensors = {name[len(prefix) + 1:]: out.pop(name) for name in list(out) if name.startswith(prefix + ".")
                   and "." not in name[len(prefix) + 1:]}
        weight = readers[method](quantization, prefix, tensors)
        if prefix.endswith(("qkv_proj", "gate_up_proj", "lm_head", "embed_tokens")) or ".experts." in prefix:
            weight = weight if isinstance(weight, np.ndarray) else weight.dequantize()  # read as floats
        out[prefix + ".weight"] = weight
        if "bias" in tensors:
            out[prefix + ".bias"] = tensors["bias"]
    return out


def _fp8(prefix: str, weight, scale, input_scale, activation_scheme: str, block) -> Fp8Matrix:
    if weight.dtype.name != "float8_e4m3fn":
        raise ValueError(f"{prefix}.weight is {weight.dtype}, not float8_e4m3fn: the checkpoint does not match its "
                         "quantization_config")
    scale = np.asarray(scale, np.float32)
    out, cols = weight.shape
    if scale.size == 1 and not block:
        scale, block = scale.reshape(1, 1), (out, cols)
    elif not block:  # one scale per output channel: [out] or [out, 1]
        scale, block = scale.reshape(-1, 1), (1, cols)
    if input_scale is not None and activation_scheme == "static":
        input_scale = float(np.max(np.asarray(input_scale, np.float32)))  # fused shards keep one each: the largest
    else:
        input_scale = None
    return Fp8Matrix(weight, scale, tuple(block), input_scale)


def _fp8_module(q, prefix, t):
    scale = t.get("weight_scale_inv", t.get("weight_scale"))
    return _fp8(prefix, t["weight"], scale, t.get("input_scale"), q.get("activation_scheme", "dynamic"),
                q.get("weight_block_size"))


def _ct_scheme(q, prefix: str) -> tuple[dict, dict | None, str]:
    """The weights' and activations' args and the format of the config group that targets `prefix`."""
    import re

    module = prefix.rsplit(".", 1)[-1]
    for group in (q.get("config_groups") or {}).values():
        for target in group.get("targets", []):
            if (target == "Linear" or target == module or target.endswith("." + module)
                    or (target.startswith("re:") and re.match(target[3:], prefix))):
                return group["weights"], group.get("input_activations"), group.get("format") or q.get("format")
    raise ValueError(f"{prefix} holds quantized tensors but no config_groups target of its quantization_config names "
                     "it: the checkpoint does not match its config")


def _ct_module(q, prefix, t):
    weights, acts, fmt = _ct_scheme(q, prefix)
    if weights["type"] == "float":
        static = acts is not None and not acts.get("dynamic")
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        return _fp8(prefix, t["weight"], t["weight_scale"], t.get("input_scale"), "static" if static else "dynamic",
                    block)
    bits, offset = weights["num_bits"], 1 << (weights["num_bits"] - 1)
    if "weight_g_idx" in t:
        g_idx = np.asarray(t["weight_g_idx"])
        group = weights.get("group_size")
        if not np.array_equal(g_idx, np.arange(g_idx.size) // group):
            raise _refuse("compressed-tensors", f"{prefix}: actorder with a permuted weight_g_idx")
    if fmt == "pack-quantized":
        out, cols = (int(v) for v in np.asarray(t["weight_shape"]))
        codes = unpack_int32(t["weight_packed"], bits, axis=1)[:, :cols]
    else:  # int-quantized / naive-quantized: int8 values
        codes = np.asarray(t["weight"]).astype(np.int32) + offset
        out, cols = codes.shape
    scales = np.asarray(t["weight_scale"], np.float32).reshape(out, -1)
    if weights.get("symmetric", True) or "weight_zero_point" not in t:
        zeros = np.full(scales.shape, offset, np.int32)
    elif fmt == "pack-quantized":
        zeros = unpack_int32(t["weight_zero_point"], bits, axis=0)[:out]  # stored z + offset already
    else:
        zeros = np.asarray(t["weight_zero_point"]).astype(np.int32).reshape(out, -1) + offset
    return group_codes(codes, scales, zeros)


def _awq_module(q, prefix, t):
    def unpack(packed):  # [rows, cols / 8] -> [rows, cols] in column order
        nibbles = unpack_int32(packed, 4, axis=1).reshape(packed.shape[0], -1, 8)
        columns = np.empty_like(nibbles)
        columns[..., list(AWQ_ORDER)] = nibbles
        return columns.reshape(packed.shape[0], -1)

    codes = unpack(t["qweight"])  # [in, out]
    zeros = unpack(t["qzeros"])  # [in / g, out]
    return group_codes(codes.T, np.asarray(t["scales"], np.float32).T, zeros.T)


def _gptq_module(q, prefix, t):
    codes = unpack_int32(t["qweight"], 4, axis=0)  # [in, out]
    zeros = unpack_int32(t["qzeros"], 4, axis=1)  # [groups, out]
    if q.get("checkpoint_format", "gptq") == "gptq":
        zeros = zeros + 1  # GPTQ v1 stores z - 1
    scales = np.asarray(t["scales"], np.float32)
    cols = codes.shape[0]
    group = q.get("group_size", 128)
    group = cols if group in (-1, None) else group
    g_idx = np.asarray(t["g_idx"]) if "g_idx" in t else np.arange(cols) // group
    if np.array_equal(g_idx, np.arange(cols) // group):
        return group_codes(codes.T, scales.T, zeros.T)
    # desc_act=True (act-order): each in-feature's group from g_idx; no 32-row blocks share a scale,
    # so this weight loads as its float32 values.
    logger.warning("%s: GPTQ desc_act=True (a permuted g_idx) is dequantized to float at load", prefix)
    return (scales[g_idx] * (codes.astype(np.float32) - zeros[g_idx])).T
