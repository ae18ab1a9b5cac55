"""A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, or the same in memory) read
and checked against the base model, as the host arrays device/lora_slots.py copies into a slot.

PEFT's state dict names each factor by the module it wraps and keeps torch's Linear layout:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and the module computes y = x W^T + scaling * (x A^T) B^T with scaling = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). Here a = A^T [in, r] and b = scaling * B^T [r, out], per layer, zeros where a
layer or module has no factors. Everything that cannot be served exactly is refused by name with a
ValueError: a rank above max_lora_rank, a module the model has no projection for (embeddings, the LM
head, fused or expert projections), a shape that does not match, DoRA, LoRA biases, modules_to_save.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.lora import target_dims
from jaxpaged.planner.lora_request import LoRARequest

# "...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight", any prefix (PEFT's base_model.model.model.).
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# adapter_config.json keys that change the arithmetic in ways not served (refused when set).
_REFUSED_CONFIG = {"use_dora": "DoRA", "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
                   "modules_to_save": "modules_to_save (fully trained copies of modules)",
                   "lora_bias": "LoRA biases (lora_bias)", "use_qalora": "QA-LoRA"}


@dataclasses.dataclass
class AdapterWeights:
    """One adapter's factors on the host, float32, scaling folded into b."""

    name: str
    lora_int_id: int
    rank: int  # the largest rank of its modules (<= max_lora_rank)
    # {module: (a [num_layers, in, rank_m], b [num_layers, rank_m, out])}, only the modules it targets
    modules: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def load_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int) -> AdapterWeights:
    """Reads `request`'s adapter and checks it against `config`; ValueError naming what is wrong."""
    who = f"LoRA adapter {request.lora_name!r} (lora_int_id={request.lora_int_id})"
    if request.lora_tensors is not None:
        adapter_config, tensors = dict(request.lora_config), request.lora_tensors
    else:
        adapter_config, tensors = _read_dir(request.lora_path, who)
    for key, what in _REFUSED_CONFIG.items():
        if adapter_config.get(key):
            raise ValueError(f"{who} uses {what}, which jaxpaged does not serve; train it without {key}")
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{who} is a {adapter_config.get('peft_type')} adapter; only PEFT LoRA adapters are served")
    alpha = adapter_config.get("lora_alpha", adapter_config.get("r", 8))
    use_rslora = bool(adapter_config.get("use_rslora", False))
    dims = target_dims(config)
    factors: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"{who}: tensor {key!r} targets a module jaxpaged cannot adapt; adapters may target "
                             f"{sorted(dims)} of the decoder layers (not embeddings, the LM head, fused or expert projections)")
        layer, _, module, factor = int(match[1]), match[2], match[3], match[4]
        if module not in dims:
            why = "MoE experts' MLP adapters are not served" if config.num_experts and module in (
                "gate_proj", "up_proj", "down_proj") else f"this model's adaptable modules are {sorted(dims)}"
            raise ValueError(f"{who}: unknown target module {module!r} ({key}); {why}")
        if layer >= config.num_layers:
            raise ValueError(f"{who}: {key} names layer {layer}, but the model has {config.num_layers} layers")
        factors.setdefault((module, layer), {})[factor] = _float32(tensor)
    if not factors:
        raise ValueError(f"{who} has no lora_A / lora_B tensors; is it a PEFT LoRA adapter?")
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for (module, layer), pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{who}: layer {layer} {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a_t, b_t = pair["A"], pair["B"]  # [r, in], [out, r]
        in_dim, out_dim = dims[module]
        r = a_t.shape[0]
        if a_t.ndim != 2 or b_t.ndim != 2 or a_t.shape != (r, in_dim) or b_t.shape != (out_dim, r):
            raise ValueError(f"{who}: layer {layer} {module} has lora_A {tuple(a_t.shape)} and lora_B "
                             f"{tuple(b_t.shape)}, expected ({r}, {in_dim}) and ({out_dim}, {r}): the adapter was "
                             "trained for another model")
        if r > max_lora_rank:
            raise ValueError(f"{who} has rank {r} ({module}), above max_lora_rank={max_lora_rank}; start the engine "
                             f"with max_lora_rank >= {r}")
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        if module not in modules:
            modules[module] = (np.zeros((config.num_layers, in_dim, r), np.float32),
                               np.zeros((config.num_layers, r, out_dim), np.float32))
        a, b = modules[module]
        if a.shape[2] != r:
            raise ValueError(f"{who}: {module} has rank {r} in layer {layer} and {a.shape[2]} in another; "
                             "one rank per module is served")
        a[layer], b[layer] = a_t.T, (b_t * scaling).T
        rank = max(rank, r)
    return AdapterWeights(request.lora_name, request.lora_int_id, rank, modules)


def _read_dir(path: str, who: str) -> tuple[dict, dict]:
    config_file = os.path.join(path, "adapter_config.json")
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
        raise ValueError(f"{who}: {path!r} has no adapter_config.json and adapter_model.safetensors; pass a PEFT "
                         "adapter directory (save_pretrained's output)")
    with open(config_file) as f:
        adapter_config = json.load(f)
    from safetensors.numpy import load_file

    try:
        return adapter_config, load_file(weights_file)
    except TypeError:  # bfloat16 tensors have no numpy dtype: read them with torch (installed with PEFT)
        from safetensors.torch import load_file as load_torch

        return adapter_config, load_torch(weights_file)


def _float32(tensor) -> np.ndarray:
    """A numpy or torch tensor (any float dtype, bfloat16 included) as a float32 numpy array."""
    if hasattr(tensor, "detach"):  # torch, without importing it
        tensor = tensor.detach().float().cpu().numpy()
    return np.asarray(tensor, dtype=np.float32)
