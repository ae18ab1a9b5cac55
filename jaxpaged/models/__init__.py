"""Decoder models over the paged KV buffer, and their configuration."""

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.hf_weights import params_from_hf
from jaxpaged.models.llama import CausalLM, init_params
from jaxpaged.models.rope_scaling import RopeScaling

__all__ = ["CausalLM", "ModelConfig", "RopeScaling", "init_params", "params_from_hf"]
