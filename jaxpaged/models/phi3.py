"""Phi-3 (`Phi3ForCausalLM`): a Llama block whose checkpoints fuse q/k/v and gate/up.

    self_attn.qkv_proj.weight  [(N + 2K) * H, D]  rows: q heads, then k heads, then v heads
    mlp.gate_up_proj.weight    [2F, D]            rows: gate, then up

`unfuse_phi3` splits them into the Llama names `params_from_hf` reads; everything else (RoPE,
RMSNorm, SiLU MLP, sliding window) is the Llama path; LongRoPE is `models/rope_scaling.py` `LongRope`.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np


def unfuse_phi3(config, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:  # arrays, or kept BlockCodes
    """`state_dict` with every fused Phi-3 tensor replaced by its Llama-named parts (others untouched)."""
    fused = [name for name in state_dict if name.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]
    if not fused:
        return state_dict
    out = {name: value for name, value in state_dict.items() if name not in fused}
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    for name in fused:
        value = np.asarray(state_dict[name])
        if name.endswith("qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            q, k, v = np.split(value, [q_rows, q_rows + kv_rows])
            out.update({prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v})
        else:
            prefix = name[: -len("gate_up_proj.weight")]
            gate, up = np.split(value, 2)
            out.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up})
    return out
