"""The cost of multi-LoRA on the CPU, and an RL trainer's adapter-only weight sync.

    python -m benchmarks.bench_lora [--batch 16] [--max-tokens 64] [--repeats 3] [--syncs 5] \
        [--json benchmarks/results/lora_cpu.json]

The bundled SmolLM2-135M-Instruct (float32). Three ways to run the same greedy batch (`--batch` chat
prompts, ignore_eos, `--max-tokens` each): the engine without LoRA; the engine with
`enable_lora=True, max_loras=4, max_lora_rank=16` serving only the base model (what the slots cost
when unused); and the same engine with 4 random rank-16 adapters on q/k/v/o/gate/up/down, requests
spread over them round-robin (4 adapters mixed in every step). Output tokens/s, best of --repeats,
the order rotating each repeat; the ratios to the plain engine are the figures.

RL sync: `add_lora` with a known id and new tensors (same name and shapes), then one request under
it (which writes the adapter's slot before its first step): seconds per sync, host part (read and
check) and the slot write separately, and whether anything compiled. The 1-minute load average is
recorded (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from benchmarks.common import environment, format_table
from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.models.lora import target_dims

QUESTIONS = ["Name a color you like and say why.", "Write one sentence about the sea.",
             "What is a good name for a cat?", "Describe your ideal breakfast."]
RANK, NUM_ADAPTERS = 16, 4


def random_adapter(model_config, rng, rank: int) -> tuple[dict, dict]:
    """A PEFT state dict on every attention and MLP projection of every layer, and its config."""
    tensors = {}
    for module, (in_dim, out_dim) in target_dims(model_config).items():
        group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for layer in range(model_config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, in_dim), np.float32) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out_dim, rank), np.float32) * 0.01
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA",
                     "target_modules": list(target_dims(model_config))}


def run(llm: LLM, prompts: list[str], loras, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    common = dict(max_model_len=256, max_num_seqs=args.batch, warmup=True)
    plain = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    rng = np.random.default_rng(0)
    adapters = [LoRARequest(f"a{i}", i + 1, lora_tensors=t, lora_config=c)
                for i, (t, c) in enumerate(random_adapter(lora.model_config, rng, RANK) for _ in range(NUM_ADAPTERS))]
    chats = [plain.get_tokenizer().apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                       tokenize=False) for q in QUESTIONS]
    prompts = (chats * args.batch)[: args.batch]
    cases = {"no LoRA engine": (plain, None), "LoRA engine, base only": (lora, None),
             f"{NUM_ADAPTERS} adapters, rank {RANK}": (lora, [adapters[i % NUM_ADAPTERS] for i in range(args.batch)])}
    for llm, loras in cases.values():  # the first run of each: sampler rows, adapters loaded; not timed
        run(llm, prompts, loras, args.max_tokens)
    best = dict.fromkeys(cases, 0.0)
    load = [os.getloadavg()[0]]
    names = list(cases)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            best[name] = max(best[name], run(*cases[name][:1], prompts, cases[name][1], args.max_tokens))
    load.append(os.getloadavg()[0])
    rows = [{"case": name, "tok_s": round(best[name], 1), "ratio": round(best[name] / best["no LoRA engine"], 3)}
            for name in cases]
    print(format_table(rows, [("case", "case"), ("output tok/s", "tok_s"), ("ratio to no LoRA", "ratio")]))

    # RL sync: new tensors for adapter a0 (same id and name), then one request under it.
    engine, slots = lora.engine, lora.engine.runner.lora
    compiles = engine.runner.num_compiles, slots.num_write_compiles
    host_s, total_s = [], []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for _ in range(args.syncs):
        tensors, config = random_adapter(lora.model_config, rng, RANK)
        t0 = time.perf_counter()
        lora.add_lora(LoRARequest("a0", 1, lora_tensors=tensors, lora_config=config))
        t1 = time.perf_counter()
        lora.generate(chats[0], one, lora_request=adapters[0])  # its first step rewrites the slot
        jax.block_until_ready(slots.stacks)
        host_s.append(t1 - t0)
        total_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(args.syncs):  # the slot write alone
        slots.write(1, engine.lora.weights(1))
        jax.block_until_ready(slots.stacks)
    write_s = (time.perf_counter() - t0) / args.syncs
    sync = {"adapter_bytes": engine.lora.weights(1).num_bytes, "slot_bytes": slots.num_bytes() // (NUM_ADAPTERS + 1),
            "host_read_check_s": round(float(np.median(host_s)), 4), "slot_write_s": round(write_s, 4),
            "sync_plus_one_token_request_s": round(float(np.median(total_s)), 4),
            "compiled_during_syncs": [engine.runner.num_compiles - compiles[0], slots.num_write_compiles - compiles[1]]}
    print(format_table([sync], [(k, k) for k in sync]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "batch": args.batch, "max_tokens": args.max_tokens,
                       "repeats": args.repeats, "rank": RANK, "num_adapters": NUM_ADAPTERS, "rows": rows,
                       "rl_sync": sync, "load_1min": load}, f, indent=1)


if __name__ == "__main__":
    main()
