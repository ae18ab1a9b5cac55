"""Loading the new families from a saved Hugging Face directory (config.json + safetensors), the way
`LLM(model=path)` does: whatever tensor names the saved files use (transformers may write Mixtral's
experts fused or one tensor per expert; Phi-3 fuses qkv and gate_up), the parameters equal those
converted from the live torch model, which tests/test_models.py checks against HF's logits."""

import json
import os

import jax
import numpy as np
import pytest

from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.models.loading import load_safetensors_dir


@pytest.mark.parametrize("name", ["mixtral-top2", "qwen3moe-top1", "phi3-window", "gemma3", "gptoss"])
def test_saved_directory_loads_to_the_same_params(name, tiny_hf_model, tmp_path):
    hf_config, model, state_dict = tiny_hf_model(name)
    model.save_pretrained(tmp_path, safe_serialization=True)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = ModelConfig.from_hf(json.load(f), dtype="float32")  # the plain dict, as loading.py reads it
    assert config == ModelConfig.from_hf(hf_config, dtype="float32")
    loaded = params_from_hf(config, load_safetensors_dir(str(tmp_path)))
    expected = params_from_hf(config, state_dict)
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, loaded, expected)


def test_per_expert_hub_names_load_like_fused_ones(tiny_hf_model):
    # Mixtral checkpoints on the Hub: block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down).
    hf_config, _, state_dict = tiny_hf_model("mixtral-top2")
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    f = config.moe_intermediate_size
    hub = {k: v for k, v in state_dict.items() if ".mlp." not in k}
    for i in range(config.num_layers):
        gate_up = state_dict[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = state_dict[f"model.layers.{i}.mlp.experts.down_proj"]
        hub[f"model.layers.{i}.block_sparse_moe.gate.weight"] = state_dict[f"model.layers.{i}.mlp.gate.weight"]
        for e in range(config.num_experts):
            prefix = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            hub[f"{prefix}.w1.weight"], hub[f"{prefix}.w3.weight"] = gate_up[e, :f], gate_up[e, f:]
            hub[f"{prefix}.w2.weight"] = down[e]
    jax.tree.map(np.testing.assert_array_equal, params_from_hf(config, hub), params_from_hf(config, state_dict))
