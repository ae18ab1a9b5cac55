"""MXFP4 expert weights of the released gpt-oss checkpoints (`quantization_config.quant_method: "mxfp4"`),
dequantized at load to the float layout of the bf16 checkpoints.

A checkpoint keeps each expert projection as two tensors (OCP Microscaling FP4, blocks of 32 values):

    {proj}_blocks  uint8 [E, out, in / 32, 16]   two FP4 (E2M1) codes a byte: value 2j the low nibble, 2j+1 the high
    {proj}_scales  uint8 [E, out, in / 32]       one power of two per block: 2 ** (scale - 127)

    E2M1 code c (4 bits): sign c >> 3, magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6)[c & 7]

`{proj}` is `mlp.experts.gate_up_proj` or `mlp.experts.down_proj`; the float tensor replacing the pair is
[E, in, out], as Hugging Face's GptOssExperts holds it (`models/moe.py` reads that).
"""

from collections.abc import Mapping
from typing import Any

import numpy as np

E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [*prefix, in, out] from blocks [*prefix, out, in / 32, 16] and scales [*prefix, out, in / 32]
    (prefix: the expert axis); ValueError naming the shapes if they do not pair up."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 3 or blocks.shape[-1] != 16
            or blocks.shape[:-1] != scales.shape):
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}{list(scales.shape)} "
                         "must be uint8 [..., out, in / 32, 16] and uint8 [..., out, in / 32]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., out, G, 16, 2]: low nibble first
    values = np.where(codes & 8, -1.0, 1.0).astype(np.float32) * E2M1_MAGNITUDES[codes & 7]
    values = values.reshape(*blocks.shape[:-1], 32) * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)  # [..., out, in] -> [..., in, out]


def dequantize_experts(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """`state_dict` with every `{proj}_blocks` / `{proj}_scales` pair replaced by the float `{proj}`
    (unchanged when it holds none); ValueError naming a blocks tensor without its scales or the reverse."""
    packed = [name for name in state_dict if name.endswith(("_blocks", "_scales"))]
    if not packed:
        return state_dict
    out = {name: value for name, value in state_dict.items() if name not in packed}
    for name in packed:
        base = name.rsplit("_", 1)[0]
        if base + "_blocks" not in state_dict or base + "_scales" not in state_dict:
            raise ValueError(f"the MXFP4 checkpoint holds {name!r} without its pair ({base}_blocks and {base}_scales "
                             "go together); re-download it")
        if name.endswith("_blocks"):
            out[base] = dequantize(state_dict[base + "_blocks"], state_dict[base + "_scales"])
    return out
