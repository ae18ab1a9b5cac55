"""Decoder models over the paged KV buffer, and their configuration."""

from jaxpaged.models.config import ModelConfig, RopeScaling
from jaxpaged.models.llama import CausalLM, init_params, params_from_hf

__all__ = ["CausalLM", "ModelConfig", "RopeScaling", "init_params", "params_from_hf"]
