"""Quantized Hugging Face checkpoints jaxpaged does not implement are refused by name (issue 53
item 5): a block-FP8 checkpoint used to load without a word and generate garbage. fp8,
compressed-tensors, AWQ and GPTQ are read now (tests/test_hf_quantized.py); other methods, and raw
quantization tensors handed to params_from_hf without their quantization_config, are refused."""

import json
import os

import numpy as np
import pytest

from jaxpaged import LLM
from tiny_checkpoint import write_tiny_checkpoint

BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def test_a_config_with_quantization_config_is_refused_naming_its_method(checkpoint, tmp_path):
    import shutil

    path = str(tmp_path / "bnb")
    shutil.copytree(checkpoint, path)
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    json.dump({**config, "quantization_config": BNB}, open(config_path, "w"))
    with pytest.raises(ValueError, match=r"quantization_config with quant_method='bitsandbytes' is not supported"):
        LLM(path, max_model_len=64, num_pages=16, warmup=False)
    assert LLM(checkpoint, max_model_len=64, num_pages=16, warmup=False).generate(["a"])  # the plain one loads


@pytest.mark.parametrize("suffix", ["weight_scale_inv", "weight_scale", "qweight", "scales"])
def test_state_dicts_with_quantization_tensors_are_refused_naming_the_tensor(checkpoint, suffix):
    from safetensors.numpy import load_file

    from jaxpaged.models import ModelConfig
    from jaxpaged.models.hf_weights import params_from_hf

    config = ModelConfig.from_hf(json.load(open(os.path.join(checkpoint, "config.json"))), dtype="float32")
    state_dict = load_file(os.path.join(checkpoint, "model.safetensors"))
    params_from_hf(config, state_dict)  # loads as it is
    name = f"model.layers.0.mlp.down_proj.{suffix}"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        params_from_hf(config, {**state_dict, name: np.ones((1, 1), np.float32)})
