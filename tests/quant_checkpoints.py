"""Quantized Hugging Face checkpoints written from a tiny random Llama, and their float32 oracles.

Each writer saves config.json (with its `quantization_config`), model.safetensors and the tokenizer, and
returns the float32 weights the format's own dequantization gives: numpy here for fp8, AWQ and GPTQ
(written independently of jaxpaged/models/hf_quant.py), compressed-tensors' own decompression for its
formats. `hf_model` loads those weights into transformers' LlamaForCausalLM in float32: the oracle.
"""

import json
import os

import numpy as np

from tiny_checkpoint import write_tiny_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# hidden 256, intermediate 320: block-FP8's 128-blocks are whole along hidden, partial along 320 columns.
SHAPE = dict(vocab_size=320, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
FP8_MAX = 448.0


def base_checkpoint(directory: str, **shape) -> tuple[str, dict]:
    """A float32 tiny Llama (tests/tiny_checkpoint.py's tokenizer) and its state dict as numpy."""
    from safetensors.numpy import load_file

    write_tiny_checkpoint(directory, **{**SHAPE, **shape})
    return directory, load_file(os.path.join(directory, "model.safetensors"))


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(tuple(f"{n}.weight" for n in LINEARS))


def save(directory: str, tensors: dict, quantization_config: dict) -> None:
    from safetensors.numpy import save_file

    os.remove(os.path.join(directory, "model.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    json.dump({**config, "quantization_config": quantization_config}, open(path, "w"))


def fp8(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def write_fp8(directory: str, granularity: str, activation_scheme: str = "dynamic",
              input_maxima: dict | None = None) -> tuple[str, dict]:
    """An HF `fp8` checkpoint: granularity "tensor" (weight_scale []), "channel" (weight_scale_inv [out, 1])
    or "block" (weight_scale_inv [ceil(out/128), ceil(in/128)], weight_block_size [128, 128]). Static:
    input_scale = input_maxima[module] / 448. Returns (directory, dequantized float32 state dict)."""
    directory, state = base_checkpoint(directory)
    tensors, oracle = {}, {}
    for name, w in state.items():
        if not is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix = name[: -len(".weight")]
        out, cols = w.shape
        if granularity == "tensor":
            scale = np.float32(np.abs(w).max() / FP8_MAX)
            q = fp8(w / scale)
            tensors[prefix + ".weight_scale"], expanded = np.asarray(scale, np.float32), scale
        elif granularity == "channel":
            scale = (np.abs(w).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)
            q = fp8(w / scale)
            tensors[prefix + ".weight_scale_inv"], expanded = scale, scale
        else:
            b = 128
            scale = np.zeros((-(-out // b), -(-cols // b)), np.float32)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    scale[i, j] = np.abs(w[i * b:(i + 1) * b, j * b:(j + 1) * b]).max() / FP8_MAX
            expanded = np.repeat(np.repeat(scale, b, 0)[:out], b, 1)[:, :cols]
            q = fp8(w / expanded)
            tensors[prefix + ".weight_scale_inv"] = scale
        tensors[name] = q
        if activation_scheme == "static":
            tensors[prefix + ".input_scale"] = np.asarray(input_maxima[prefix] / FP8_MAX, np.float32)
        oracle[name] = q.astype(np.float32) * expanded
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activation_scheme,
              "modules_to_not_convert": ["lm_head"]}
    if granularity == "block":
        config["weight_block_size"] = [128, 128]
    save(directory, tensors, config)
    return directory, oracle


def input_maxima(state: dict, prompts: list[list[int]]) -> dict:
    """max |x| into each linear layer of the float model `state` over `prompts` (static activation scales)."""
    import torch

    model, maxima = hf_model(state), {}

    def hook(prefix):
        def record(module, args):
            maxima[prefix] = max(maxima.get(prefix, 0.0), float(args[0].abs().max()))
        return record

    for name, module in model.named_modules():
        if name.startswith("model.layers.") and name.endswith(LINEARS):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return maxima


def hf_model(state: dict, activation_quant: dict | None = None):
    """transformers' LlamaForCausalLM in float32 with `state`'s weights (SHAPE). `activation_quant`
    {module prefix: ("dynamic", group) | ("static", scale)}: that linear's input is quantized to
    float8_e4m3fn first (per token, per token and `group` in-features, or by the static scale) and
    dequantized: the W8A8 oracle (the product of two dequantized operands)."""
    import torch
    import transformers

    shape = {**SHAPE, "hidden_size": state["model.embed_tokens.weight"].shape[1],
             "intermediate_size": state["model.layers.0.mlp.up_proj.weight"].shape[0],
             "vocab_size": state["model.embed_tokens.weight"].shape[0]}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).float().eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()})
    for name, module in model.named_modules():
        if activation_quant and name in activation_quant:
            module.register_forward_pre_hook(_fake_quant(*activation_quant[name]))
    return model


def _fake_quant(kind, value):
    import torch

    def quantize(module, args):
        x = args[0].float()
        if kind == "static":
            s = torch.tensor(value, dtype=torch.float32)
            q = (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        else:
            groups = x.reshape(*x.shape[:-1], -1, value or x.shape[-1])
            s = (groups.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
            q = ((groups / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).reshape(x.shape)
        return (q,)

    return quantize


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def hf_token_logprobs(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`, teacher-forced."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


def write_compressed_tensors(directory: str, weights: dict, fmt: str, input_activations: dict | None = None,
                             calibration: dict | None = None) -> tuple[str, dict]:
    """A compressed-tensors checkpoint written by compressed-tensors itself: `weights` are its
    QuantizationArgs fields (e.g. num_bits 4, type "int", symmetric, strategy "group", group_size 32),
    scales and zero points computed from each weight's min / max (`calculate_qparams`), the format one
    of its compressors ("pack-quantized", "float-quantized"). Static input activations take
    `calibration[module] / 448`. Returns (directory, the weights compressed-tensors' own decompression gives)."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    directory, state = base_checkpoint(directory)
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    args = QuantizationArgs(**weights)
    acts = QuantizationArgs(**input_activations) if input_activations else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight
            if args.strategy == "group":
                w = w.reshape(w.shape[0], -1, args.group_size)
            elif args.strategy == "block":
                b0, b1 = args.block_structure
                w = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1).transpose(1, 2)
                w = w.reshape(w.shape[0], w.shape[1], -1)
            elif args.strategy == "tensor":
                w = w.reshape(1, 1, -1)
            else:  # channel
                w = w.reshape(w.shape[0], 1, -1)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):
                module.input_scale.copy_(torch.tensor(calibration[name] / FP8_MAX).reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    quantization_config = compressor.quantization_config.model_dump(mode="json")
    compressor.decompress_model(model)  # the oracle: compressed-tensors' own dequantization
    oracle = {k: v.float().numpy() for k, v in model.state_dict().items() if k in state}
    os.remove(os.path.join(directory, "model.safetensors"))
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    path = os.path.join(directory, "config.json")
    json.dump({**json.load(open(path)), "quantization_config": quantization_config}, open(path, "w"))
    return directory, oracle


def _quantize_groups(w: np.ndarray, g_idx: np.ndarray, groups: int, symmetric: bool):
    """4-bit codes q [out, in], scales and zeros [out, groups] with w ~ scales * (q - zeros), each
    in-feature k in group g_idx[k] (scales rounded to float16, as the formats store them)."""
    out = w.shape[0]
    scales, zeros = np.zeros((out, groups), np.float32), np.zeros((out, groups), np.int64)
    for g in range(groups):
        part = w[:, g_idx == g]
        if symmetric:
            scales[:, g] = np.abs(part).max(axis=1) / 7.5
            zeros[:, g] = 8
        else:
            lo, hi = np.minimum(part.min(axis=1), 0), np.maximum(part.max(axis=1), 0)
            scales[:, g] = (hi - lo) / 15
            zeros[:, g] = np.clip(np.round(-lo / scales[:, g]), 0, 15)
    scales = scales.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, 15).astype(np.int64)
    return q, scales, zeros


def _pack_nibbles(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[rows, 8n] 4-bit values -> int32 [rows, n]: word c's nibble i (bits 4i) holds column 8c + order[i]."""
    rows, cols = values.shape
    words = np.zeros((rows, cols // 8), np.uint32)
    for i, column in enumerate(order):
        words |= (values[:, column::8].astype(np.uint32) & 15) << np.uint32(4 * i)
    return words.view(np.int32)


def write_awq(directory: str, group: int = 64) -> tuple[str, dict]:
    """An AutoAWQ GEMM checkpoint (asymmetric 4 bits, `group` in-features a scale): qweight [in, out/8] and
    qzeros [in/g, out/8] int32 with AWQ's column order 0 2 4 6 1 3 5 7, scales float16 [in/g, out]."""
    directory, state = base_checkpoint(directory)
    tensors, oracle = {}, {}
    for name, w in state.items():
        if not is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix, cols = name[: -len(".weight")], w.shape[1]
        q, scales, zeros = _quantize_groups(w, np.arange(cols) // group, cols // group, symmetric=False)
        tensors[prefix + ".qweight"] = _pack_nibbles(q.T, (0, 2, 4, 6, 1, 3, 5, 7))
        tensors[prefix + ".qzeros"] = _pack_nibbles(zeros.T, (0, 2, 4, 6, 1, 3, 5, 7))
        tensors[prefix + ".scales"] = scales.T.astype(np.float16)
        oracle[name] = (scales[:, np.arange(cols) // group] * (q - zeros[:, np.arange(cols) // group])).astype(np.float32)
    save(directory, tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                              "version": "gemm", "modules_to_not_convert": None})
    return directory, oracle


def write_gptq(directory: str, group: int = 64, desc_act: bool = False, symmetric: bool = True) -> tuple[str, dict]:
    """A GPTQ (v1) checkpoint: qweight int32 [in/8, out] (in-feature 8i + j in word i's bits 4j), qzeros
    int32 [groups, out/8] holding z - 1, scales float16 [groups, out], g_idx [in]; desc_act: g_idx a
    permutation of the groups (act-order)."""
    directory, state = base_checkpoint(directory)
    rng = np.random.default_rng(1)
    tensors, oracle = {}, {}
    for name, w in state.items():
        if not is_linear(name):
            tensors[name] = oracle[name] = w
            continue
        prefix, cols = name[: -len(".weight")], w.shape[1]
        g_idx = np.arange(cols) // group
        if desc_act:
            g_idx = g_idx[rng.permutation(cols)]
        q, scales, zeros = _quantize_groups(w, g_idx, cols // group, symmetric)
        tensors[prefix + ".qweight"] = _pack_rows(q.T)
        tensors[prefix + ".qzeros"] = _pack_nibbles((zeros.T - 1) & 15)
        tensors[prefix + ".scales"] = scales.T.astype(np.float16)
        tensors[prefix + ".g_idx"] = g_idx.astype(np.int32)
        oracle[name] = (scales[:, g_idx] * (q - zeros[:, g_idx])).astype(np.float32)
    save(directory, tensors, {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                              "sym": symmetric, "checkpoint_format": "gptq"})
    return directory, oracle


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """[8n, cols] 4-bit values -> int32 [n, cols]: word i's bits 4j hold row 8i + j (GPTQ's qweight)."""
    return _pack_nibbles(values.T).T.copy()


def write_float(directory: str, state: dict) -> str:
    """The tiny checkpoint with `state`'s float32 weights and no quantization_config: a dequantized twin."""
    from safetensors.numpy import save_file

    directory, _ = base_checkpoint(directory, hidden_size=state["model.embed_tokens.weight"].shape[1],
                                   intermediate_size=state["model.layers.0.mlp.up_proj.weight"].shape[0])
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()},
              os.path.join(directory, "model.safetensors"))
    return directory
