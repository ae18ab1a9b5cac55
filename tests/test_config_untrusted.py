"""config.json files from strangers (issue 53 item 5): every size is checked before anything is derived
from it or allocated by it; a missing, mistyped, out-of-bounds or inconsistent value is a ValueError
that names the field, never a TypeError, a ZeroDivisionError or a model of absurd size. Real configs of
every family still read (their files are the oracle: tests/data/configs or transformers' defaults)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.models import ModelConfig

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
GEMMA3 = {**LLAMA, "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "head_dim": 16,
          "sliding_window": 32, "query_pre_attn_scalar": 16, "num_hidden_layers": 6}
PHI3 = {**LLAMA, "model_type": "phi3"}
BASES = {"llama": LLAMA, "mixtral": MIXTRAL, "gemma3_text": GEMMA3, "phi3": PHI3}

# Read as ModelConfig field: the HF name -> ModelConfig's name for the same number.
SAME_VALUE = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
              "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
              "max_position_embeddings": "max_position_embeddings", "head_dim": "head_dim",
              "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
              "sliding_window": "sliding_window"}


@pytest.mark.parametrize("name", sorted(BASES))
def test_the_base_configs_read(name):
    config = ModelConfig.from_hf(BASES[name], dtype="float32")
    assert config.vocab_size == 320 and config.num_heads == 4


@pytest.mark.parametrize("field,value,words", [
    ("num_attention_heads", 0, "num_attention_heads=0 must lie in [1, 1024]"),  # was ZeroDivisionError
    ("num_attention_heads", None, "no num_attention_heads"),  # was TypeError
    ("hidden_size", "64", "hidden_size='64' must be an integer"),  # was TypeError
    ("hidden_size", 64.0, "hidden_size=64.0 must be an integer"),
    ("num_hidden_layers", True, "num_hidden_layers=True must be an integer"),
    ("vocab_size", 10**12, "vocab_size=1000000000000 must lie in [1, 4194304]"),
    ("max_position_embeddings", 1 << 40, "max_position_embeddings=1099511627776 must lie"),
    ("hidden_size", 66, "hidden_size=66 is not divisible by num_attention_heads=4"),
    ("num_key_value_heads", 3, "num_key_value_heads=3 must divide num_attention_heads=4"),
    ("num_key_value_heads", 8, "num_key_value_heads=8 must divide num_attention_heads=4"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06 must be a positive finite number"),
    ("rope_theta", math.inf, "rope_theta=inf must be a positive finite number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),  # was read as True
    ("rope_scaling", "llama3", "rope_scaling='llama3' must be an object"),
    ("layer_types", ["full_attention"], "layer_types must list one entry per layer"),
])
def test_a_bad_value_is_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf({**LLAMA, field: value}, dtype="float32")
    assert words in str(err.value)


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=5 is more than its 4 experts"):
        ModelConfig.from_hf({**MIXTRAL, "num_experts_per_tok": 5}, dtype="float32")
    with pytest.raises(ValueError, match="needs num_local_experts"):
        ModelConfig.from_hf({k: v for k, v in MIXTRAL.items() if k != "num_local_experts"}, dtype="float32")


VALUES = st.one_of(
    st.integers(min_value=-2, max_value=5), st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([64, 128, 320, 1 << 22, (1 << 22) + 1, 1 << 24, (1 << 24) + 1, 1024, 1025]),
    st.booleans(), st.none(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = sorted({*SAME_VALUE, "intermediate_size", "moe_intermediate_size", "rms_norm_eps", "rope_theta",
                 "tie_word_embeddings", "attention_bias", "rope_scaling", "layer_types", "sliding_window_pattern",
                 "query_pre_attn_scalar", "rope_parameters", "quantization_config", "partial_rotary_factor",
                 "decoder_sparse_step", "mlp_only_layers"})


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from(sorted(BASES)), field=st.sampled_from(FIELDS), value=VALUES)
def test_any_value_of_any_field_reads_or_is_refused_naming_it(base, field, value):
    """One field of a valid config set to anything: either the config reads, and then the value is the
    one read and within bounds, or a ValueError names the field (or the one it must agree with)."""
    try:
        config = ModelConfig.from_hf({**BASES[base], field: value}, dtype="float32")
    except ValueError as err:
        message = str(err)
        partners = {"num_attention_heads": ("num_key_value_heads", "hidden_size"),
                    "hidden_size": ("num_attention_heads",), "num_hidden_layers": ("layer_types", "num_layers"),
                    "num_local_experts": ("num_experts_per_tok", "num_experts"),
                    "num_experts_per_tok": ("num_local_experts",)}
        assert field in message or any(p in message for p in partners.get(field, ())), (field, value, message)
        return
    moe_only = field in ("num_local_experts", "num_experts_per_tok") and base != "mixtral"
    if field in SAME_VALUE and value is not None and not moe_only:
        assert getattr(config, SAME_VALUE[field]) == value
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "max_position_embeddings"):
        assert 1 <= getattr(config, name) <= 1 << 24
    assert config.num_heads % config.num_kv_heads == 0


def test_a_gguf_with_zero_heads_is_refused_naming_the_field():
    from jaxpaged.models.gguf import gguf_to_hf_config

    metadata = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 0,
                "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.context_length": 256,
                "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 320}
    with pytest.raises(ValueError, match=r"num_attention_heads=0 must lie in \[1, 1024\]"):  # was ZeroDivisionError
        ModelConfig.from_hf(gguf_to_hf_config(metadata, tie_word_embeddings=True))
