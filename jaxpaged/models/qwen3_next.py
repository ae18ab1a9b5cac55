"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet linear-attention layers between gated full-attention
layers, a routed MoE with a sigmoid-gated shared expert in every layer. Semantics: transformers'
modeling_qwen3_next.py.

The step's state is a pair: the paged KV buffer of the full-attention layers only, and the linear
layers' per-sequence state in fixed slots (the planner hands each running sequence one:
planner/state_pool.py; slot 0 is the padding slot, never handed out):

    kv_pages:  [num_kv_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
    conv:      [num_linear_layers, num_slots, conv_kernel - 1, conv_dim]   the last inputs of the causal conv
    recurrent: [num_linear_layers, num_slots, num_v_heads, key_head_dim, value_head_dim]   float32

`state_slots[s]` is sequence row s's slot. A row whose step starts at position 0 (a prompt, or a
recomputed one after preemption) starts from zeros whatever its slot holds; any other row continues
from its slot (a later prefill chunk, a decode). Each row's final state is written back to its slot.

A Gated DeltaNet layer, per token (q, k L2-normalised, q scaled by key_head_dim^-1/2, value head h
reading key head h // (num_v_heads / num_k_heads)):

    S <- S * exp(g)                          g = -exp(A_log) * softplus(a + dt_bias)
    S <- S + k (beta * (v - S^T k))^T        beta = sigmoid(b)
    o  = S^T q                               then RMSNorm(o) * weight * silu(z), out_proj

computed in blocks of CHUNK_SIZE tokens in steps with prefill rows (`chunked_gated_delta_rule`: one
triangular solve per block, all rows at once), token by token in decode-only steps
(`gated_delta_rule`: one iteration).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import AttentionFn, MLP, RMSNorm, apply_rope, rope_inv_freq, write_kv
from jaxpaged.models.moe import ExpertFn, MoE, grouped_experts
from jaxpaged.ops.attention import reference_paged_attention

_init = nn.initializers.normal(stddev=0.02)

LinearState = tuple[Float[Array, "num_linear_layers num_slots conv_len conv_dim"],
                    Float[Array, "num_linear_layers num_slots num_v_heads key_head_dim value_head_dim"]]


def linear_state_shapes(config: ModelConfig, num_slots: int) -> tuple[tuple, tuple]:
    """Shapes of (conv, recurrent) for `num_slots` slots (slot 0 included)."""
    c = config
    num_linear = c.num_layers - c.num_kv_layers
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return ((num_linear, num_slots, c.linear_conv_kernel_dim - 1, conv_dim),
            (num_linear, num_slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim))


def zeros_linear_state(config: ModelConfig, num_slots: int, zeros=jnp.zeros) -> LinearState:
    conv_shape, recurrent_shape = linear_state_shapes(config, num_slots)
    return zeros(conv_shape, config.dtype), zeros(recurrent_shape, jnp.float32)


def state_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes of one sequence's linear-attention state over every linear layer."""
    conv_shape, recurrent_shape = linear_state_shapes(config, 1)
    return int(np.prod(conv_shape)) * jnp.dtype(config.dtype).itemsize + int(np.prod(recurrent_shape)) * 4


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def token_rows(query_start_loc: Int[Array, "num_seqs_plus_1"], num_tokens: int):
    """(row of each token [T], its index inside the row's chunk [T], valid [T]); padding tokens invalid."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    valid = t < query_start_loc[-1]
    row = jnp.where(valid, row, 0)
    return row, t - query_start_loc[row], valid


def causal_conv(mixed: Float[Array, "num_tokens conv_dim"], weight: Float[Array, "conv_kernel conv_dim"],
                conv_init: Float[Array, "num_seqs conv_len conv_dim"], query_start_loc, row, idx):
    """silu(depthwise causal conv) of every token over its row's earlier inputs (the chunk's, then
    `conv_init`, the row's last K-1 inputs before the chunk), and each row's new last K-1 inputs."""
    kernel = weight.shape[0]
    num_tokens = mixed.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)

    def input_at(tok, rows, rel):  # input rel positions into the row's chunk (rel < 0: from conv_init)
        from_chunk = mixed[jnp.clip(tok, 0, num_tokens - 1)]
        from_state = conv_init[rows, jnp.clip(kernel - 1 + rel, 0, kernel - 2)]
        return jnp.where((rel >= 0)[:, None], from_chunk, from_state)

    acc = jnp.zeros(mixed.shape, jnp.float32)
    for j in range(kernel):  # tap j reads lookback K-1-j
        back = kernel - 1 - j
        acc = acc + weight[j].astype(jnp.float32) * input_at(t - back, row, idx - back).astype(jnp.float32)
    out = jax.nn.silu(acc).astype(mixed.dtype)
    num_rows = conv_init.shape[0]
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    new_state = jnp.stack([
        input_at(query_start_loc[:-1] + q_len - (kernel - 1) + i, rows, q_len - (kernel - 1) + i)
        for i in range(kernel - 1)], axis=1)  # [S, K-1, C]
    return out, new_state.astype(conv_init.dtype)


def gated_delta_rule(q, k, v, g, beta, state0, query_start_loc):
    """The recurrent gated delta rule over each row's chunk, all rows at once.

    q, k: [T, Hv, Dk] (normalised, q scaled); v: [T, Hv, Dv]; g, beta: [T, Hv] float32; state0 [S, Hv, Dk, Dv].
    Returns (out [T, Hv, Dv] float32, final state [S, Hv, Dk, Dv])."""
    num_tokens = q.shape[0]
    starts = query_start_loc[:-1]
    q_len = query_start_loc[1:] - starts
    out0 = jnp.zeros(v.shape, jnp.float32)

    def body(j, carry):
        state, out = carry
        active = j < q_len  # [S]
        tok = jnp.clip(starts + j, 0, num_tokens - 1)
        q_t, k_t, v_t = q[tok], k[tok], v[tok]  # [S, Hv, D]
        decayed = state * jnp.exp(g[tok])[:, :, None, None]
        kv_mem = jnp.einsum("shkv,shk->shv", decayed, k_t)
        delta = (v_t - kv_mem) * beta[tok][:, :, None]
        new = decayed + k_t[:, :, :, None] * delta[:, :, None, :]
        o = jnp.einsum("shkv,shk->shv", new, q_t)
        state = jnp.where(active[:, None, None, None], new, state)
        out = out.at[jnp.where(active, starts + j, num_tokens)].set(o, mode="drop")
        return state, out

    state, out = jax.lax.fori_loop(0, jnp.max(q_len), body, (state0, out0))
    return out, state


# Tokens per block of the chunked form (HF's and vLLM's chunk size).
CHUNK_SIZE = 64


def chunked_gated_delta_rule(q, k, v, g, beta, state0, query_start_loc, chunk: int = CHUNK_SIZE):
    """`gated_delta_rule`'s function, a block of `chunk` tokens of every row at a time (the prefill form).

    In a block, with D_t = exp(G_t) the decay from the block's start (G the cumulative sum of g) and S0 the
    state there, the rows u_j = beta_j (v_j - (decayed S_{j-1})^T k_j) the recurrence writes solve

        (I + A) U = beta V - (beta D K) S0,    A[j, i] = beta_j (D_j / D_i) k_j.k_i  for i < j

    (one unit lower-triangular solve), then O = (D Q) S0 + (Q K^T * [D_t / D_j]_{j<=t}) U and the block's
    final state is D_C S0 + (K D_C / D)^T U. Positions past a row's length get k = v = beta = g = 0: they
    write nothing and decay nothing."""
    num_tokens, num_heads, _ = q.shape
    starts = query_start_loc[:-1]
    q_len = query_start_loc[1:] - starts
    out0 = jnp.zeros(v.shape, jnp.float32)
    lower_incl = jnp.tril(jnp.ones((chunk, chunk), bool))
    offsets = jnp.arange(chunk, dtype=jnp.int32)

    def body(b, carry):
        state, out = carry
        pos = b * chunk + offsets  # [C] position in each row's chunk
        active = pos[None, :] < q_len[:, None]  # [S, C]
        tok = jnp.clip(starts[:, None] + pos[None, :], 0, num_tokens - 1)
        mask = active[:, :, None]
        q_b = q[tok]  # [S, C, H, Dk]
        k_b = jnp.where(mask[..., None], k[tok], 0.0)
        v_b = jnp.where(mask[..., None], v[tok], 0.0)
        g_b = jnp.where(mask, g[tok], 0.0)  # [S, C, H]
        beta_b = jnp.where(mask, beta[tok], 0.0)
        cum = jnp.cumsum(g_b, axis=1)  # G_t
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [S, t, j, H]: G_t - G_j
        ratio = jnp.where(lower_incl[None, :, :, None], jnp.exp(jnp.where(lower_incl[None, :, :, None], diff, 0.0)), 0.0)
        kk = jnp.einsum("sthd,sjhd->stjh", k_b, k_b)
        strict = ratio * ~jnp.eye(chunk, dtype=bool)[None, :, :, None]
        a = beta_b[:, :, None, :] * strict * kk  # [S, j, i, H]
        decay = jnp.exp(cum)  # D_t [S, C, H]
        rhs = beta_b[..., None] * (v_b - jnp.einsum("sjhk,shkv->sjhv", k_b * decay[..., None], state))
        lhs = jnp.moveaxis(a, 3, 1) + jnp.eye(chunk)  # [S, H, C, C]
        u = jax.lax.linalg.triangular_solve(lhs, jnp.moveaxis(rhs, 2, 1), left_side=True, lower=True,
                                            unit_diagonal=True)  # [S, H, C, Dv]
        u = jnp.moveaxis(u, 1, 2)  # [S, C, H, Dv]
        qk = jnp.einsum("sthd,sjhd->stjh", q_b, k_b) * ratio
        o = jnp.einsum("sthk,shkv->sthv", q_b * decay[..., None], state) + jnp.einsum("stjh,sjhv->sthv", qk, u)
        last = cum[:, -1]  # [S, H]
        tail = jnp.exp(last[:, None, :] - cum)  # D_C / D_j
        state = jnp.exp(last)[:, :, None, None] * state + jnp.einsum("sjhk,sjhv->shkv", k_b * tail[..., None], u)
        out = out.at[jnp.where(active, starts[:, None] + pos[None, :], num_tokens)].set(o, mode="drop")
        return state, out

    num_blocks = (jnp.max(q_len) + chunk - 1) // chunk
    state, out = jax.lax.fori_loop(0, num_blocks, body, (state0, out0))
    return out, state


class GatedDeltaNet(nn.Module):
    config: ModelConfig
    dtype: jnp.dtype
    decode_only: bool = False  # static: one token per row, the recurrent form (else the chunked form)

    @nn.compact
    def __call__(self, x, conv_init, recurrent_init, query_start_loc, row, idx):
        c, dtype = self.config, self.dtype
        num_tokens, dim = x.shape
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        r = hv // hk
        conv_dim = 2 * hk * dk + hv * dv
        qkvz = x @ self.param("in_proj_qkvz", _init, (dim, 2 * hk * dk + 2 * hv * dv), dtype)
        qkvz = qkvz.reshape(num_tokens, hk, 2 * dk + 2 * r * dv)  # HF's grouping: per key head q, k, its v's, its z's
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(num_tokens, hv * dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(num_tokens, hv, dv)
        ba = (x @ self.param("in_proj_ba", _init, (dim, 2 * hv), dtype)).reshape(num_tokens, hk, 2 * r)
        b, a = ba[..., :r].reshape(num_tokens, hv), ba[..., r:].reshape(num_tokens, hv)
        mixed = jnp.concatenate([q.reshape(num_tokens, hk * dk), k.reshape(num_tokens, hk * dk), v], axis=-1)
        mixed, conv_state = causal_conv(mixed, self.param("conv", _init, (c.linear_conv_kernel_dim, conv_dim), dtype),
                                        conv_init, query_start_loc, row, idx)
        q = mixed[:, : hk * dk].reshape(num_tokens, hk, dk).astype(jnp.float32)
        k = mixed[:, hk * dk : 2 * hk * dk].reshape(num_tokens, hk, dk).astype(jnp.float32)
        v = mixed[:, 2 * hk * dk :].reshape(num_tokens, hv, dv).astype(jnp.float32)
        q, k = jnp.repeat(_l2norm(q), r, axis=1) * dk**-0.5, jnp.repeat(_l2norm(k), r, axis=1)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), dtype).astype(jnp.float32)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), dtype).astype(jnp.float32)
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        delta_rule = gated_delta_rule if self.decode_only else chunked_gated_delta_rule
        out, recurrent = delta_rule(q, k, v, g, beta, recurrent_init, query_start_loc)
        # Gated RMSNorm over each value head (HF's Qwen3NextRMSNormGated: weight times the normed value
        # in the activation dtype, then silu(z) in float32).
        out = out.astype(dtype).astype(jnp.float32)
        normed = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + c.rms_norm_eps)
        weight = self.param("norm", nn.initializers.ones, (dv,), dtype)
        out = ((weight * normed.astype(dtype)).astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        y = out.reshape(num_tokens, hv * dv) @ self.param("out_proj", _init, (hv * dv, dim), dtype)
        return y, conv_state, recurrent


class GatedAttention(nn.Module):
    """Full attention with an output gate (sigmoid of q_proj's second half per head), (1 + w) q/k norms and
    RoPE on the first `partial_rotary_factor` of head_dim."""

    config: ModelConfig
    dtype: jnp.dtype
    attention_fn: AttentionFn
    decode_only: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, kv_pages, kv_idx, slot_mapping, block_tables, seq_lens, query_start_loc):
        c, dtype = self.config, self.dtype
        num_tokens, dim = x.shape
        n, kh, h = c.num_heads, c.num_kv_heads, c.head_dim
        qg = (x @ self.param("q_proj", _init, (dim, n * 2 * h), dtype)).reshape(num_tokens, n, 2 * h)
        q, gate = qg[..., :h], qg[..., h:].reshape(num_tokens, n * h)
        key = (x @ self.param("k_proj", _init, (dim, kh * h), dtype)).reshape(num_tokens, kh, h)
        value = (x @ self.param("v_proj", _init, (dim, kh * h), dtype)).reshape(num_tokens, kh, h)
        q = RMSNorm(c.rms_norm_eps, dtype, True, name="q_norm")(q)
        key = RMSNorm(c.rms_norm_eps, dtype, True, name="k_norm")(key)
        rot = cos.shape[-1] * 2

        def rope(t):
            return jnp.concatenate([apply_rope(t[..., :rot], cos, sin), t[..., rot:]], axis=-1)

        q, key = rope(q), rope(key)
        kv_pages = write_kv(kv_pages, kv_idx, key, value, slot_mapping)
        extra = {"decode_only": True} if self.decode_only and getattr(self.attention_fn, "has_decode_kernel", False) else {}
        if getattr(self.attention_fn, "reads_whole_kv_buffer", False):
            out = self.attention_fn(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=kv_idx,
                                    scale=h**-0.5, **extra)
        else:
            out = self.attention_fn(q, kv_pages[kv_idx, 0], kv_pages[kv_idx, 1], block_tables, seq_lens,
                                    query_start_loc, scale=h**-0.5, **extra)
        out = out.astype(dtype).reshape(num_tokens, n * h)
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype)
        return out @ self.param("o_proj", _init, (n * h, dim), dtype), kv_pages


class SharedExpertMoE(nn.Module):
    """The routed experts plus a shared expert whose output is scaled by sigmoid(x @ shared_expert_gate)."""

    config: ModelConfig
    dtype: jnp.dtype
    expert_fn: ExpertFn = grouped_experts

    @nn.compact
    def __call__(self, x):
        c = self.config
        routed = MoE(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, c.hidden_act,
                     self.dtype, self.expert_fn, name="moe")(x)
        shared = MLP(c.shared_expert_intermediate_size, self.dtype, c.hidden_act, name="shared_expert")(x)
        gate = jax.nn.sigmoid(x @ self.param("shared_expert_gate", _init, (x.shape[-1], 1), self.dtype))
        return routed + gate * shared


class Qwen3NextLM(nn.Module):
    """`CausalLM`'s contract (models/llama.py) with the pair `(kv_pages, (conv, recurrent))` as the step's
    state and `state_slots` (each row's slot) as one more input. Layers unrolled: they differ in kind."""

    config: ModelConfig
    attention_fn: AttentionFn = reference_paged_attention
    decode_only: bool = False
    expert_fn: ExpertFn = grouped_experts

    @nn.compact
    def __call__(
        self,
        kv_state: tuple,
        token_ids: Int[Array, "num_tokens"],
        positions: Int[Array, "num_tokens"],
        slot_mapping: Int[Array, "num_tokens"],
        block_tables: Int[Array, "num_seqs pages_per_seq"],
        seq_lens: Int[Array, "num_seqs"],
        query_start_loc: Int[Array, "num_seqs_plus_1"],
        logits_indices: Int[Array, "num_logits"],
        kv_centres=None,
        state_slots: Int[Array, "num_seqs"] | None = None,
    ):
        c, dtype = self.config, jnp.dtype(self.config.dtype)
        kv_pages, (conv, recurrent) = kv_state
        num_tokens = token_ids.shape[0]
        if state_slots is None:  # (init, shapes) every row reads the padding slot
            state_slots = jnp.zeros(seq_lens.shape, jnp.int32)
        x = self.param("embedding", _init, (c.vocab_size, c.hidden_size), dtype)[token_ids]
        rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        inv_freq = jnp.asarray(rope_inv_freq(rotary_dim, c.rope_theta, None))
        angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        row, idx, _ = token_rows(query_start_loc, num_tokens)
        q_len = query_start_loc[1:] - query_start_loc[:-1]
        fresh = (seq_lens - q_len) == 0  # the row starts at position 0: its state starts at zeros
        norm = lambda name: RMSNorm(c.rms_norm_eps, dtype, True, name=name)
        kv_idx = lin_idx = 0
        for i, kind in enumerate(c.layer_types):
            h = norm(f"layer_{i}_input_norm")(x)
            if kind == "linear_attention":
                conv_init = jnp.where(fresh[:, None, None], 0, conv[lin_idx, state_slots]).astype(conv.dtype)
                rec_init = jnp.where(fresh[:, None, None, None], 0.0, recurrent[lin_idx, state_slots])
                h, conv_new, rec_new = GatedDeltaNet(c, dtype, self.decode_only, name=f"layer_{i}_linear_attn")(
                    h, conv_init, rec_init, query_start_loc, row, idx)
                conv = conv.at[lin_idx, state_slots].set(conv_new)
                recurrent = recurrent.at[lin_idx, state_slots].set(rec_new)
                lin_idx += 1
            else:
                h, kv_pages = GatedAttention(c, dtype, self.attention_fn, self.decode_only, name=f"layer_{i}_attn")(
                    h, cos, sin, kv_pages, jnp.int32(kv_idx), slot_mapping, block_tables, seq_lens, query_start_loc)
                kv_idx += 1
            x = x + h
            h = norm(f"layer_{i}_post_attn_norm")(x)
            if c.num_experts:
                h = SharedExpertMoE(c, dtype, self.expert_fn, name=f"layer_{i}_mlp")(h)
            else:
                h = MLP(c.intermediate_size, dtype, c.hidden_act, name=f"layer_{i}_mlp")(h)
            x = x + h
        x = norm("final_norm")(x[logits_indices])
        logits = jnp.einsum("SD,DV->SV", x, self.param("lm_head", _init, (c.hidden_size, c.vocab_size), dtype),
                            preferred_element_type=jnp.float32)
        return logits, (kv_pages, (conv, recurrent))


def param_shapes(config: ModelConfig):
    """The parameter tree as `jax.ShapeDtypeStruct`s (`eval_shape` of the module's init: nothing runs)."""
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    kv_pages = jax.ShapeDtypeStruct((config.num_kv_layers, 2, config.num_kv_heads, 2, 4, config.head_dim), config.dtype)
    state = jax.eval_shape(lambda: zeros_linear_state(config, 1))
    return jax.eval_shape(Qwen3NextLM(config).init, jax.random.key(0), (kv_pages, state), ints(4), ints(4), ints(4),
                          ints(1, 1), ints(1), ints(2), ints(1))


def params_from_hf(config: ModelConfig, tensor, has) -> dict:
    """Qwen3-Next's parameter tree from HF names (`tensor(name)` float32 numpy, `has(name)`), `(out, in)` ->
    `(in, out)`, cast to the model dtype."""
    from jaxpaged.models.moe import moe_params_from_hf

    c, dtype = config, jnp.dtype(config.dtype)
    params = {"embedding": tensor("model.embed_tokens.weight"), "final_norm": {"scale": tensor("model.norm.weight")},
              "lm_head": (tensor("model.embed_tokens.weight") if c.tie_word_embeddings else tensor("lm_head.weight")).T}
    for i, kind in enumerate(c.layer_types):
        layer = lambda suffix, i=i: tensor(f"model.layers.{i}.{suffix}")
        params[f"layer_{i}_input_norm"] = {"scale": layer("input_layernorm.weight")}
        params[f"layer_{i}_post_attn_norm"] = {"scale": layer("post_attention_layernorm.weight")}
        if kind == "linear_attention":
            params[f"layer_{i}_linear_attn"] = {
                "in_proj_qkvz": layer("linear_attn.in_proj_qkvz.weight").T,
                "in_proj_ba": layer("linear_attn.in_proj_ba.weight").T,
                "conv": layer("linear_attn.conv1d.weight")[:, 0, :].T,  # [C, 1, K] -> [K, C]
                "A_log": layer("linear_attn.A_log"), "dt_bias": layer("linear_attn.dt_bias"),
                "norm": layer("linear_attn.norm.weight"), "out_proj": layer("linear_attn.out_proj.weight").T,
            }
        else:
            params[f"layer_{i}_attn"] = {
                "q_proj": layer("self_attn.q_proj.weight").T, "k_proj": layer("self_attn.k_proj.weight").T,
                "v_proj": layer("self_attn.v_proj.weight").T, "o_proj": layer("self_attn.o_proj.weight").T,
                "q_norm": {"scale": layer("self_attn.q_norm.weight")}, "k_norm": {"scale": layer("self_attn.k_norm.weight")},
            }
        if c.num_experts:
            params[f"layer_{i}_mlp"] = {
                "moe": moe_params_from_hf(c.num_experts, c.moe_intermediate_size, layer,
                                          lambda suffix, i=i: has(f"model.layers.{i}.{suffix}")),
                "shared_expert": {n: layer(f"mlp.shared_expert.{n}.weight").T for n in ("gate_proj", "up_proj", "down_proj")},
                "shared_expert_gate": layer("mlp.shared_expert_gate.weight").T,
            }
        else:
            params[f"layer_{i}_mlp"] = {n: layer(f"mlp.{n}.weight").T for n in ("gate_proj", "up_proj", "down_proj")}
    return {"params": jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)}
