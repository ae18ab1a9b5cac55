"""GRPO on the bundled SmolLM2-135M-Instruct with jaxpaged as the rollout engine and optax as the trainer.

    for each iteration:
        rollouts    llm.generate(prompts, SamplingParams(n=G, logprobs=0))   (the engine, batch_invariant=True)
        reward      1 if the completion says "blue", else 0                     (a toy verifiable task)
        advantage   (r - mean of its group) / (std of its group + 1e-4)        (GRPO: no value network)
        training    one optax step on the clipped policy-gradient loss over the completion tokens; the
                    policy forward is jaxpaged.rl.token_logprobs over the trainer's copy of the weights
        weight sync llm.update_params(params)   (llm.sleep(level=2) frees the engine's memory while
                    the trainer runs; wake_up() brings its KV pool back)

Old-policy log-probabilities are the engine's chosen-token logprobs (`SamplingParams(logprobs=0)`, at
temperature 1 the model's own distribution). The engine runs with `batch_invariant=True` and the
trainer's forward is the engine's own arithmetic (`token_logprobs`), so before each update the
importance ratios exp(logp_trainer - logp_engine) are exactly 1 on every token: the script prints
the largest |ratio - 1| (0 when sampler and trainer agree bit for bit).

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
from jaxpaged.rl import token_logprobs

PROMPTS = ["My favorite color is", "The sky today looks", "I painted my room", "Her new car is"]
TARGET = "blue"
TEMPERATURE = 1.0


def reward(text: str) -> float:
    return float(TARGET in text.lower())


def grpo_loss(params, config, page_size, tokens, starts, lengths, old_logprobs, advantages, clip=0.2):
    """Clipped policy-gradient loss, averaged over completion tokens; also the largest |ratio - 1|."""
    logprobs = token_logprobs(params, config, tokens, starts, lengths=lengths, temperature=TEMPERATURE,
                              page_size=page_size)  # [B, T], 0 outside each row's completion
    position = jnp.arange(tokens.shape[1])[None, :]
    mask = ((position >= starts[:, None]) & (position < lengths[:, None])).astype(jnp.float32)
    ratio = jnp.exp(logprobs - old_logprobs)
    per_token = jnp.minimum(ratio * advantages[:, None], jnp.clip(ratio, 1 - clip, 1 + clip) * advantages[:, None])
    loss = -jnp.sum(per_token * mask) / jnp.sum(mask)
    return loss, jnp.max(jnp.abs(ratio - 1.0) * mask)


# ---------------------------------------------------------------- one iteration's batch

def build_batch(outputs, group_size, max_len):
    """Right-padded rows prompt + completion, each row's completion span [start, length), the engine's
    logprobs at those positions, GRPO advantages."""
    rows, starts, lengths, old, rewards = [], [], [], [], []
    for request in outputs:
        for completion in request.outputs:
            prompt, generated = request.prompt_token_ids, completion.token_ids
            chosen = [entry[token].logprob for entry, token in zip(completion.logprobs, generated)]
            rows.append((prompt + generated + [0] * max_len)[:max_len])
            old.append(([0.0] * len(prompt) + chosen + [0.0] * max_len)[:max_len])
            starts.append(len(prompt)), lengths.append(len(prompt) + len(generated))
            rewards.append(reward(completion.text))
    r = np.asarray(rewards, np.float32).reshape(-1, group_size)
    advantages = ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)
    return (np.asarray(rows, np.int32), np.asarray(starts, np.int32), np.asarray(lengths, np.int32),
            np.asarray(old, np.float32), advantages.astype(np.float32), float(r.mean()))


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
    llm = LLM(max_model_len=64, max_num_seqs=len(PROMPTS) * args.group_size, seed=args.seed, warmup=False,
              batch_invariant=True)
    config, page_size = llm.engine.model_config, llm.config.page_size
    params = jax.tree.map(jnp.array, llm.params)  # the trainer's own copy (the engine keeps its own)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    @jax.jit(donate_argnums=(0, 1))  # the old params and optimizer state are not needed again
    def train_step(params, opt_state, tokens, starts, lengths, old_logprobs, advantages):
        (loss, drift), grads = jax.value_and_grad(grpo_loss, has_aux=True)(
            params, config, page_size, tokens, starts, lengths, old_logprobs, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, drift

    print(f"{'iter':>4} {'reward':>7} {'loss':>8} {'max|ratio-1|':>12} {'generate s':>10} {'train s':>8} {'sync s':>7}")
    totals = {"generate": 0.0, "train": 0.0, "sync": 0.0}
    rewards = []
    for it in range(args.iterations):
        t0 = time.perf_counter()
        sampling = SamplingParams(n=args.group_size, temperature=TEMPERATURE, max_tokens=args.max_tokens, logprobs=0,
                                  ignore_eos=True, seed=args.seed * 1000 + it)
        outputs = llm.generate(PROMPTS, sampling)
        t1 = time.perf_counter()
        max_len = max(len(r.prompt_token_ids) for r in outputs) + args.max_tokens  # fixed: compiles once
        tokens, starts, lengths, old, advantages, mean_reward = build_batch(outputs, args.group_size, max_len)
        if not args.no_sleep:
            llm.sleep(level=2)  # the trainer gets the device: KV pool and the engine's weights freed
        params, opt_state, loss, drift = train_step(params, opt_state, tokens, starts, lengths, old, advantages)
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
        print(f"{it:>4} {mean_reward:>7.3f} {float(loss):>8.4f} {float(drift):>12.1e} "
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
