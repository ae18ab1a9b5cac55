"""Read a llama.cpp GGUF file into a Hugging Face config and a Hugging Face state dict.

The output is the loader contract (see `loading.py`): a Hugging Face config (`HFConfig`) and a
`dict[str, np.ndarray]` in Hugging Face naming and layout, float32, so `hf_weights.params_from_hf` does
not know the weights came from a GGUF file. Three things differ from a Hugging Face checkpoint:

1. Names: llama.cpp calls `model.layers.3.self_attn.q_proj.weight` `blk.3.attn_q.weight`.
2. Quantization: most matrices are stored in blocks (Q4_1, Q8_0, ...); `gguf.quants.dequantize`
   turns each into float32. What comes out is the quantized model's weights, not the original
   bf16 ones: the oracle for tests is Hugging Face's own GGUF loader, never the original checkpoint.
3. The rows of q_proj and k_proj are permuted (see `unpermute_qk_rows`).

GGUF lists a tensor's dimensions fastest-first (`[in, out]` for a matrix), so read row-major the
dequantized data has the reversed shape, `(out, in)`: Hugging Face's `nn.Linear` layout, no transpose.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpaged.models import gguf_blocks, gguf_families
from jaxpaged.models.gguf_families import SUPPORTED_ARCHITECTURES

# llama.cpp name (with `{i}` for the layer) -> Hugging Face name.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp writes that a Llama state dict has no place for (precomputed RoPE tables).
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: GGUF's dims reversed, e.g. (out, in)
    qtype: int  # a gguf.GGMLQuantizationType value
    data: np.ndarray  # the raw bytes, uint8 [rows, bytes_per_row], memory-mapped


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header: metadata as Python values, tensors as memory-mapped raw bytes."""

    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


# GGUF metadata value types -> struct format of one scalar (8: string, 9: array, handled apart).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF (v2/v3, little-endian) header; tensor data stays on disk, memory-mapped.

    Our own parser rather than `gguf.GGUFReader`, which builds a numpy view per array element and
    takes ~7 s on this file's 49152-token vocabulary (this takes well under one). Layout:

        "GGUF" u32 version  u64 tensor_count  u64 kv_count
        kv_count x   (string key, u32 value_type, value)         string = u64 length + utf-8 bytes
        tensor_count x (string name, u32 n_dims, u64 dims[n_dims] fastest-first, u32 type, u64 offset)
        padding to `general.alignment` (default 32), then the data; `offset` counts from there
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist; pass the path of a .gguf file")
    buf = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
    raw = memoryview(buf)
    size = len(raw)
    if bytes(raw[:4]) != b"GGUF":
        raise ValueError(f"{path!r} is not a GGUF file (its first bytes are {bytes(raw[:4])!r}, not b'GGUF')")
    # A hostile or corrupt file: every count, length and offset below is checked against the bytes
    # the file has before anything is read or allocated (ValueError naming the problem).
    pos = 4

    def corrupt(what: str) -> ValueError:
        return ValueError(f"{path!r} is a corrupt or truncated GGUF file: {what}; re-download or re-convert it")

    def unpack(fmt: str, what: str) -> tuple:
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise corrupt(f"{what} at byte {pos} needs {n} bytes, the file ends at {size}")
        values = struct.unpack_from(fmt, raw, pos)
        pos += n
        return values

    version, tensor_count, kv_count = unpack("<IQQ", "the header")
    if version not in (2, 3):
        raise ValueError(f"{path!r} is GGUF version {version}; only versions 2 and 3 (little-endian) are supported")
    # Each key/value pair takes at least 13 bytes, each tensor info at least 24: counts past that are lies.
    if kv_count > (size - pos) // 13 or tensor_count > (size - pos) // 24:
        raise corrupt(f"{kv_count} metadata fields and {tensor_count} tensors cannot fit in {size} bytes")

    def read_string(what: str) -> str:
        nonlocal pos
        (length,) = unpack("<Q", what)
        if length > size - pos:
            raise corrupt(f"{what} of {length} bytes at byte {pos}, past the file's end ({size})")
        pos += length
        return bytes(raw[pos - length : pos]).decode("utf-8", errors="replace")

    def read_value(value_type: int, key: str, depth: int = 0) -> Any:
        nonlocal pos
        if value_type == _STRING:
            return read_string(f"the string value of {key!r}")
        if value_type == _ARRAY:
            item_type, count = unpack("<IQ", f"the array header of {key!r}")
            if depth or item_type == _ARRAY:
                raise corrupt(f"{key!r} is an array of arrays, which GGUF models do not use")
            item_size = 8 if item_type == _STRING else struct.calcsize("<" + _SCALAR_FORMATS.get(item_type, "B"))
            if count > (size - pos) // item_size:
                raise corrupt(f"{key!r} claims {count} items, more than the {size - pos} bytes left hold")
            if item_type in _SCALAR_FORMATS:  # one unpack for the whole array
                return list(unpack(f"<{count}{_SCALAR_FORMATS[item_type]}", f"the values of {key!r}"))
            return [read_value(item_type, key, depth + 1) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{path!r}: unknown GGUF metadata value type {value_type} at byte {pos}")
        (value,) = unpack("<" + _SCALAR_FORMATS[value_type], f"the value of {key!r}")
        return value

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = read_string("a metadata key")
        (value_type,) = unpack("<I", f"the type of {key!r}")
        metadata[key] = read_value(value_type, key)

    infos = []
    for _ in range(tensor_count):
        name = read_string("a tensor name")
        (n_dims,) = unpack("<I", f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise corrupt(f"tensor {name!r} has {n_dims} dimensions (GGUF tensors have 1 to {_MAX_DIMS})")
        dims = unpack(f"<{n_dims}Q", f"the shape of tensor {name!r}")
        qtype, offset = unpack("<IQ", f"the type and offset of tensor {name!r}")
        infos.append((name, tuple(int(d) for d in dims), qtype, offset))

    alignment = metadata.get("general.alignment", 32)
    if not (isinstance(alignment, int) and 1 <= alignment <= 1 << 16 and not alignment & (alignment - 1)):
        raise corrupt(f"general.alignment={alignment!r} is not a power of two up to 65536")
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        try:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise corrupt(f"tensor {name!r} has an unknown data type {qtype}") from None
        row_len = dims[0]  # elements in one row (the fastest dimension)
        if row_len % block_size:
            raise ValueError(f"{path!r}: tensor {name} rows of {row_len} are not whole blocks of {block_size}")
        num_rows = 1
        for d in dims[1:]:
            num_rows *= d  # Python ints: no overflow before the size check
        row_bytes = row_len // block_size * type_size
        begin, nbytes = data_start + offset, num_rows * row_bytes
        if begin + nbytes > size:
            raise corrupt(f"tensor {name!r} ({nbytes} bytes at offset {offset}) ends past the file's end ({size})")
        data = buf[begin : begin + nbytes].reshape(num_rows, row_bytes)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), qtype, data))
    return GGUFFile(path, metadata, tensors)


def read_metadata(gguf_file: GGUFFile) -> dict[str, Any]:
    """Every key/value field of the file as plain Python values (str, int, float, bool, lists)."""
    return gguf_file.metadata


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for ignored tensors."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name in _IGNORED:
        return None
    parts = name.split(".")  # ["blk", "3", "attn_q", "weight"]
    names = {**_LAYER_NAMES, **gguf_families.MOE_LAYER_NAMES}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise ValueError(
        f"GGUF tensor {name!r} has no Hugging Face Llama name; this loader knows "
        f"{sorted(_GLOBAL_NAMES)} and blk.N.{{{', '.join(_LAYER_NAMES | gguf_families.MOE_LAYER_NAMES)}}}.weight"
    )


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of the rows of q_proj / k_proj (per head).

    Hugging Face applies RoPE "rotate half": within a head of `head_dim` rows, row j pairs with row
    j + head_dim/2. llama.cpp rotates adjacent pairs (2j, 2j+1), so its converter moved row j of the
    first half to 2j and row j of the second half to 2j+1. For head_dim = 8, one head:

        Hugging Face row:  0 1 2 3 | 4 5 6 7        (halves, pairs (0,4) (1,5) ...)
        GGUF row:          0 4 1 5 2 6 3 7          (pairs adjacent)

    Reading GGUF rows as `[head, pair_idx, half]` and swapping to `[head, half, pair_idx]` restores
    the Hugging Face order. `num_heads` is the number of heads this matrix projects to (query heads
    for q_proj, KV heads for k_proj). Works for a weight `(out, in)` or a bias `(out,)`.
    """
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads):
        raise ValueError(f"{num_rows=} rows cannot be split into {num_heads=} heads of an even head_dim")
    half = num_rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [head, pair_idx, half, ...]
    return grouped.swapaxes(1, 2).reshape(weight.shape)  # [head, half, pair_idx, ...] flattened


def gguf_to_hf_config(metadata: dict[str, Any], *, tie_word_embeddings: bool) -> HFConfig:
    """The Hugging Face `config.json` of a GGUF, from its `{arch}.*` and `tokenizer.ggml.*` fields
    (Llama, Mixtral, Qwen3-MoE: models/gguf_families.py).

    GGUF has no tying flag: the file ties the LM head to the embedding when it has no `output.weight`.
    A plain `HFConfig` (dict with attribute access), not a `transformers.LlamaConfig`, because
    importing transformers' config classes imports torch; `transformers.LlamaConfig(**config)`
    makes one where wanted (tests).
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES}); "
            "use a Hugging Face directory with config.json and *.safetensors instead"
        )

    def field(name: str, default: Any = None) -> Any:
        key = f"{arch}.{name}"
        if key not in metadata and default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}; the file is incomplete or not a {arch} model")
        return metadata.get(key, default)

    hidden_size = int(field("embedding_length"))
    num_heads = int(field("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", metadata.get(f"{arch}.rope.dimension_count", 0)))
    head_dim = head_dim or (hidden_size // num_heads if num_heads else 0)  # 0 heads: refused by name (hf_config.py)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab_size == 0:
        raise ValueError("GGUF metadata gives no vocabulary size (no llama.vocab_size, no tokenizer.ggml.tokens)")
    return HFConfig(
        **gguf_families.family_config(arch, metadata, field),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=int(field("feed_forward_length")),
        num_hidden_layers=int(field("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(field("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(field("context_length")),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )


class HFConfig(dict):
    """A Hugging Face `config.json` as a dict that also reads as attributes (`config.hidden_size`).

    `ModelConfig.from_hf` takes it like a `PretrainedConfig`. Missing keys read as None through
    attributes, as absent optional fields of a `PretrainedConfig` subclass would be defaults.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)


def load_gguf(path_or_file, *, weights: bool = True, keep_blocks: bool = False):
    """`(hf_config, state_dict, metadata)` of a GGUF Llama file.

    The state dict is float32 numpy in Hugging Face names and layout (None when `weights=False`:
    the config and tokenizer metadata come from the header alone, no tensor is dequantized).
    `keep_blocks` (quantization="gguf"): layer projections stored as Q4_0 / Q4_1 / Q8_0 come as
    `gguf_blocks.BlockCodes` instead, in the same (out, in) layout.
    A file without `output.weight` ties the LM head to the embedding: the config says
    `tie_word_embeddings=True` and the state dict has no `lm_head.weight` (as Hugging Face's own).
    Pass an open file (`open_gguf`) to parse the file's header once for config and tokenizer.
    """
    gguf_file = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    metadata = read_metadata(gguf_file)
    tensor_names = {tensor.name for tensor in gguf_file.tensors}
    config = gguf_to_hf_config(metadata, tie_word_embeddings="output.weight" not in tensor_names)
    if not weights:
        return config, None, metadata
    state_dict = dequantize_state_dict(gguf_file, config, metadata["general.architecture"], keep_blocks)
    gguf_families.fuse_experts(state_dict, config.num_hidden_layers)
    check_llama_state_dict(config, state_dict)
    return config, state_dict, metadata


# Layer projections that `keep_blocks` may keep as codes (the model dequantizes them: gguf_blocks.py).
KEPT_PROJECTIONS = tuple(f"{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}.weight"
                         for name in gguf_blocks.PROJECTIONS)
# ... and the embedding, which params_from_hf keeps as codes where it is tied (gguf_blocks.keeps_embedding).
KEPT_TENSORS = (*KEPT_PROJECTIONS, "model.embed_tokens.weight")


def dequantize_state_dict(gguf_file, config, arch: str = "llama", keep_blocks: bool = False) -> dict:
    """Every tensor of the file as float32 numpy, renamed, Q/K rows restored to Hugging Face order;
    with `keep_blocks`, layer projections and the embedding of a kept block type as `BlockCodes`
    (reordered alike)."""
    permuted = arch in gguf_families.PERMUTED_QK_ARCHITECTURES
    from gguf.quants import dequantize

    state_dict: dict = {}
    for tensor in gguf_file.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        if keep_blocks and tensor.qtype in gguf_blocks.KEPT_TYPES and hf_name.endswith(KEPT_TENSORS):
            weight = gguf_blocks.unpack(tensor.data, tensor.qtype, tensor.shape)
        else:  # [rows, bytes_per_row] -> float32 [rows, row_len] -> (out, in): no transpose needed.
            weight = np.asarray(dequantize(tensor.data, tensor.qtype), dtype=np.float32).reshape(tensor.shape)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = reorder_rows(weight, lambda w: unpermute_qk_rows(w, config.num_attention_heads))
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = reorder_rows(weight, lambda w: unpermute_qk_rows(w, config.num_key_value_heads))
        state_dict[hf_name] = weight if isinstance(weight, gguf_blocks.BlockCodes) else np.ascontiguousarray(weight)
    return state_dict


def reorder_rows(weight, fn):
    """`fn` (a row reordering) of a float matrix, or of each part of a `BlockCodes` (rows are whole blocks)."""
    return weight.map_rows(lambda part: np.ascontiguousarray(fn(part))) if isinstance(
        weight, gguf_blocks.BlockCodes) else fn(weight)


def check_llama_state_dict(config, state_dict: dict[str, Any]) -> None:  # arrays, or kept BlockCodes
    """Raise if a tensor is missing or has the wrong shape for `config` (catches a transposed read)."""
    hidden, vocab = config.hidden_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    expected = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        expected[prefix + "self_attn.q_proj.weight"] = (q_out, hidden)
        expected[prefix + "self_attn.k_proj.weight"] = (kv_out, hidden)
        expected[prefix + "self_attn.v_proj.weight"] = (kv_out, hidden)
        expected[prefix + "self_attn.o_proj.weight"] = (hidden, q_out)
        expected.update(gguf_families.expected_mlp_shapes(config, prefix))
        expected[prefix + "input_layernorm.weight"] = (hidden,)
        expected[prefix + "post_attention_layernorm.weight"] = (hidden,)
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}")
    for name, shape in expected.items():
        if state_dict[name].shape != shape:
            raise ValueError(f"{name} has shape {state_dict[name].shape}, config implies {shape}")
