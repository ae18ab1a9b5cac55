"""LoRA in the model's forward: every row of the batch under its own adapter, in one grouped computation.

A projection y = x W of a layer gets, per token t under adapter slot s_t,

    y_t += (x_t A[s_t]) B[s_t]        A: [in, R], B: [R, out], B already times the adapter's scaling

The device holds `num_slots = max_loras + 1` adapters per target module, stacked and zero-padded to
rank R = max_lora_rank (device/lora_slots.py); slot 0 is all zeros: the base model. Rather than
gather an [in, R] matrix per token, x is multiplied by every slot's A at once and the rows are masked
by their slot (a one-hot [T, S] matrix), then one einsum with the stacked B sums each row's own slot:

    xa = einsum("TI,SIR->TSR", x, A) * onehot[:, :, None]      T=num_tokens S=num_slots I=in R=rank
    y += einsum("TSR,SRO->TO", xa, B)                          O=out

Exact: a row's other slots contribute exact zeros, and padded rank columns are zero in A and B. The
extra work is 2 * T * S * R * (I + O) multiply-adds per projection against the base's T * I * O: small
while S * R << min(I, O). Shapes depend only on (max_loras, max_lora_rank), never on which adapters
are loaded, so loading or switching adapters never recompiles.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.models.config import ModelConfig

# The projections an adapter may target, by Hugging Face's module name (target_dims: their shapes).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def target_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{module: (in_dim, out_dim)} of every projection an adapter may target on this model; a MoE model's
    MLP is its experts, which adapters may not target (models/peft_adapter.py refuses them by name)."""
    d, n, k, h, f = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    dims = {"q_proj": (d, n * h), "k_proj": (d, k * h), "v_proj": (d, k * h), "o_proj": (n * h, d)}
    if not config.num_experts:
        dims |= {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    return dims


def slot_rows(token_slots: Int[Array, "num_tokens"], num_slots: int, dtype) -> Float[Array, "num_tokens num_slots"]:
    """The one-hot [T, S] mask of each token's adapter slot (slot 0: the base model, whose A and B are 0)."""
    return (token_slots[:, None] == jnp.arange(num_slots, dtype=token_slots.dtype)[None, :]).astype(dtype)


def add_lora(y: Float[Array, "num_tokens ..."], x: Float[Array, "num_tokens ..."], lora, name: str):
    """y plus each token's adapter delta for projection `name`; y unchanged if `lora` is None or has no
    stack for `name`. `lora`: (rows [T, S] one-hot, {name: {"a": [S, I, R], "b": [S, R, O]}}) of one layer."""
    if lora is None or name not in lora[1]:
        return y
    rows, stacks = lora
    a, b = stacks[name]["a"], stacks[name]["b"]
    # The barrier gives the adapter's dot an operand of its own: else XLA's dot merger joins x A with the
    # base projections reading x (x Wq, x Wk, x Wv, x Aq, ...) into one dot over [Wq | Wk | Wv | Aq | ...],
    # a concatenation that copied every base weight in every step (the H100 profile: 1.35x the ideal bytes).
    x2 = jax.lax.optimization_barrier(x.reshape(x.shape[0], -1).astype(a.dtype))  # [T, I]
    xa = jnp.einsum("TI,SIR->TSR", x2, a) * rows[:, :, None]  # each row keeps its own slot's R columns
    delta = jnp.einsum("TSR,SRO->TO", xa, b)  # [T, O]
    return y + delta.reshape(y.shape).astype(y.dtype)
