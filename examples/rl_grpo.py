"""GRPO on the bundled SmolLM2-135M-Instruct with jaxpaged as the rollout engine and optax as the trainer.

    for each iteration:
        rollouts    llm.generate(prompts, SamplingParams(n=G, logprobs=0))   (the engine)
        reward      1 if the completion says "blue", else 0                     (a toy verifiable task)
        advantage   (r - mean of its group) / (std of its group + 1e-4)        (GRPO: no value network)
        training    one optax step on the clipped policy-gradient loss over the completion tokens,
                    through a plain dense forward over the engine's own parameter tree
        weight sync llm.update_params(params)   (llm.sleep(level=2) frees the engine's memory while
                    the trainer runs; wake_up() brings its KV pool back)

Old-policy log-probabilities are the engine's chosen-token logprobs (`SamplingParams(logprobs=0)`,
at temperature 1 the model's own distribution); the script prints how far the trainer's dense
forward is from them (a check that trainer and engine run the same model).

    python examples/rl_grpo.py                 # 6 iterations, a few minutes on a laptop CPU
    python examples/rl_grpo.py --iterations 12 --lr 3e-5

Needs optax: pip install 'jaxpaged[examples]'.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.llama import apply_rope, rope_inv_freq

PROMPTS = ["My favorite color is", "The sky today looks", "I painted my room", "Her new car is"]
TARGET = "blue"


def reward(text: str) -> float:
    return float(TARGET in text.lower())


# ---------------------------------------------------------------- the trainer's model: a dense forward

def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return scale * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def dense_logits(params, config, tokens):
    """Logits [B, T, V] of right-padded token rows [B, T]: the math of models/llama.py CausalLM without
    pages (causal softmax attention over the row itself), differentiable end to end."""
    p, c = params["params"], config
    B, T = tokens.shape
    x = p["embedding"][tokens]  # [B, T, D]
    angles = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    rope = jax.vmap(apply_rope, in_axes=(0, None, None))  # over the batch
    causal = jnp.tril(jnp.ones((T, T), bool))
    group = c.num_heads // c.num_kv_heads

    def layer(x, lp):
        a = lp["attn"]
        h = _rms(x, lp["input_norm"]["scale"], c.rms_norm_eps)
        q = jnp.einsum("BTD,DNH->BTNH", h, a["q_proj"])
        k = jnp.einsum("BTD,DKH->BTKH", h, a["k_proj"])
        v = jnp.einsum("BTD,DKH->BTKH", h, a["v_proj"])
        if c.attention_bias:
            q, k, v = q + a["q_bias"], k + a["k_bias"], v + a["v_bias"]
        if c.qk_norm:
            q, k = _rms(q, a["q_norm"]["scale"], c.rms_norm_eps), _rms(k, a["k_norm"]["scale"], c.rms_norm_eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # GQA: [B, T, N, H]
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k).astype(jnp.float32) * c.head_dim**-0.5
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
        y = jnp.einsum("BTNH,NHD->BTD", jnp.einsum("BNTS,BSNH->BTNH", probs, v), a["o_proj"])
        if c.o_proj_bias:
            y = y + a["o_bias"]
        x = x + y
        m = lp["mlp"]
        h = _rms(x, lp["post_attn_norm"]["scale"], c.rms_norm_eps)
        gate, up = jnp.einsum("BTD,DF->BTF", h, m["gate_proj"]), jnp.einsum("BTD,DF->BTF", h, m["up_proj"])
        return x + jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, m["down_proj"]), None

    x, _ = jax.lax.scan(jax.checkpoint(layer), x, p["layers"])
    x = _rms(x, p["final_norm"]["scale"], c.rms_norm_eps)
    lm_head = p["embedding"].T if c.tie_word_embeddings else p["lm_head"]
    return jnp.einsum("BTD,DV->BTV", x, lm_head, preferred_element_type=jnp.float32)


def token_logprobs(params, config, tokens):
    """log p(tokens[:, t] | tokens[:, :t]) for t >= 1: [B, T-1]."""
    logits = dense_logits(params, config, tokens)[:, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]


def grpo_loss(params, config, tokens, mask, old_logprobs, advantages, clip=0.2):
    """Clipped policy-gradient loss, averaged over completion tokens (mask [B, T-1])."""
    logprobs = token_logprobs(params, config, tokens)
    ratio = jnp.exp(logprobs - old_logprobs)
    per_token = jnp.minimum(ratio * advantages[:, None], jnp.clip(ratio, 1 - clip, 1 + clip) * advantages[:, None])
    loss = -jnp.sum(per_token * mask) / jnp.sum(mask)
    return loss, jnp.sum(jnp.abs(logprobs - old_logprobs) * mask) / jnp.sum(mask)


# ---------------------------------------------------------------- one iteration's batch

def build_batch(outputs, group_size, max_len):
    """Right-padded rows prompt + completion, the completion mask, engine logprobs, GRPO advantages."""
    rows, masks, old, rewards = [], [], [], []
    for request in outputs:
        for completion in request.outputs:
            prompt, generated = request.prompt_token_ids, completion.token_ids
            row = (prompt + generated + [0] * max_len)[:max_len]
            mask = ([0.0] * (len(prompt) - 1) + [1.0] * len(generated) + [0.0] * max_len)[: max_len - 1]
            lp = ([0.0] * (len(prompt) - 1) + list(completion.logprobs) + [0.0] * max_len)[: max_len - 1]
            rows.append(row), masks.append(mask), old.append(lp), rewards.append(reward(completion.text))
    r = np.asarray(rewards, np.float32).reshape(-1, group_size)
    advantages = ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)
    return (np.asarray(rows, np.int32), np.asarray(masks, np.float32), np.asarray(old, np.float32),
            advantages.astype(np.float32), float(r.mean()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO's G)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sleep", action="store_true", help="keep the engine's memory while training")
    args = parser.parse_args()

    # No warm-up: only the buckets these fixed-shape rollouts use compile, in iteration 0 (ignore_eos below
    # keeps every sample to max_tokens, so later iterations use the same ones).
    llm = LLM(max_model_len=64, max_num_seqs=len(PROMPTS) * args.group_size, seed=args.seed, warmup=False)
    config = llm.engine.model_config
    params = jax.tree.map(jnp.array, llm.params)  # the trainer's own copy (the engine keeps its own)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    @jax.jit(donate_argnums=(0, 1))  # the old params and optimizer state are not needed again
    def train_step(params, opt_state, tokens, mask, old_logprobs, advantages):
        (loss, drift), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
            params, config, tokens, mask, old_logprobs, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, drift

    print(f"{'iter':>4} {'reward':>7} {'loss':>8} {'|dlogp|':>8} {'generate s':>10} {'train s':>8} {'sync s':>7}")
    totals = {"generate": 0.0, "train": 0.0, "sync": 0.0}
    rewards = []
    for it in range(args.iterations):
        t0 = time.perf_counter()
        sampling = SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, logprobs=0,
                                  ignore_eos=True, seed=args.seed * 1000 + it)
        outputs = llm.generate(PROMPTS, sampling)
        t1 = time.perf_counter()
        max_len = max(len(r.prompt_token_ids) for r in outputs) + args.max_tokens  # fixed: compiles once
        tokens, mask, old, advantages, mean_reward = build_batch(outputs, args.group_size, max_len)
        if not args.no_sleep:
            llm.sleep(level=2)  # the trainer gets the device: KV pool and the engine's weights freed
        params, opt_state, loss, drift = train_step(params, opt_state, tokens, mask, old, advantages)
        jax.block_until_ready(params)
        t2 = time.perf_counter()
        llm.update_params(params, version=it + 1)
        if not args.no_sleep:
            llm.wake_up()
        t3 = time.perf_counter()
        split = {"generate": t1 - t0, "train": t2 - t1, "sync": t3 - t2}
        for key, value in split.items():
            totals[key] += value if it else 0.0  # iteration 0 compiles the train step: left out of the totals
        rewards.append(mean_reward)
        print(f"{it:>4} {mean_reward:>7.3f} {float(loss):>8.4f} {float(drift):>8.1e} "
              f"{split['generate']:>10.2f} {split['train']:>8.2f} {split['sync']:>7.2f}", flush=True)
    final = llm.generate(PROMPTS, SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens,
                                                 ignore_eos=True, seed=args.seed * 1000 + args.iterations))
    final_reward = float(np.mean([reward(c.text) for r in final for c in r.outputs]))
    whole = sum(totals.values())
    print(f"reward: first iteration {rewards[0]:.3f} -> after training {final_reward:.3f}")
    if args.iterations > 1:
        print("time split over iterations 1..: " + ", ".join(
            f"{k} {v:.1f} s ({100 * v / whole:.0f}%)" for k, v in totals.items()))


if __name__ == "__main__":
    main()
