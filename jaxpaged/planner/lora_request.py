"""`LoRARequest`: which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`).

A request names its adapter by `lora_name` and a positive `lora_int_id` (the engine's key: two
requests with the same id share one loaded adapter and its device slot), and says where its weights
are: `lora_path`, a PEFT directory (adapter_config.json + adapter_model.safetensors), or, instead,
`lora_tensors` (PEFT's state dict, name -> array) with `lora_config` (adapter_config.json's dict) in
memory. Reading and checking the weights is models/peft_adapter.py's; pure Python here (no jax).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class LoRARequest:
    lora_name: str  # the adapter's name (the server's `model=` name)
    lora_int_id: int  # > 0, unique per adapter: the engine's key for it
    lora_path: str = ""  # a PEFT adapter directory; "" when lora_tensors are given
    # In memory instead of a path: PEFT's state dict ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    # -> [r, in] array, numpy or torch) and adapter_config.json's dict (r, lora_alpha, use_rslora, ...).
    lora_tensors: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    lora_config: dict[str, Any] | None = None
    base_model_name: str | None = None  # vLLM's field; the server's /v1/models "parent" when given

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 (0 is the base model)")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if bool(self.lora_path) == (self.lora_tensors is not None):
            raise ValueError(f"LoRARequest {self.lora_name!r}: give lora_path (a PEFT directory) or lora_tensors "
                             "(with lora_config), exactly one")
        if self.lora_tensors is not None and not isinstance(self.lora_config, dict):
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_tensors need lora_config, adapter_config.json's "
                             "dict (r, lora_alpha, target_modules, ...)")

    # vLLM's older spellings
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
