"""The requests benchmarks/bench_vs_vllm.py feeds to jaxpaged and to real vLLM, and the pure-Python
checks on what they return, token ids offline and texts from the servers of bench_serving.py (no
jax, no vllm: unit-tested in tests/test_peer_workloads.py).

Every prompt is a list of token ids, so both engines see exactly the same input. A workload's
`prompts_for(call)` gives the prompts of one generate call: the same for every call, except where
the workload has a shared prefix that is drawn afresh for each call (W2), so that prefix-cache hits
come only from requests of the same call sharing it, never from the previous repeat.
"""

from __future__ import annotations

import dataclasses
import random

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for a job interview.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Why do cats purr?",
    "Summarize the story of Cinderella in one sentence.",
    "What are the primary colors?",
    "How many minutes are in a day? Show the arithmetic.",
    "Write a short thank-you note to a neighbour.",
    "What does a compiler do?",
    "Recommend a book for someone who likes space.",
    "Translate 'thank you very much' into French.",
    "What should I pack for a weekend hike?",
]


@dataclasses.dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[dict]  # per request: temperature, max_tokens, ignore_eos, seed (both engines read these)
    compare_tokens: bool  # greedy: the two engines must produce the same ids
    fresh_prefix_len: int = 0  # >0: the first this-many tokens of every prompt are redrawn per call

    def prompts_for(self, call: int) -> list[list[int]]:
        """The prompts of generate call number `call` (0 is the warm-up); the same for every system."""
        if not self.fresh_prefix_len:
            return self.prompts
        rng = random.Random(1000 + call)
        prefix = [rng.randint(0, 10000) for _ in range(self.fresh_prefix_len)]
        return [prefix + p[self.fresh_prefix_len:] for p in self.prompts]


def chat_workload(tokenizer) -> Workload:
    """16 chat questions through the chat template, 48 greedy tokens, stopping at EOS as a chat would."""
    prompts = []
    for question in CHAT_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))  # the template writes any BOS itself
    params = [{"temperature": 0.0, "max_tokens": 48, "ignore_eos": False, "seed": None}] * len(prompts)
    return Workload("chat-greedy", prompts, params, compare_tokens=True)


def w1_workloads(num_seqs: int = 16, min_len: int = 16, max_len: int = 128) -> list[Workload]:
    """W1 scaled to the CPU, greedy (for the cross-check) and at temperature 0.6 (W1 proper)."""
    # Draw order as bench_throughput.workload_w1: all prompts first, then one output length per request.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    out_lens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    greedy = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True, "seed": None} for n in out_lens]
    sampled = [{"temperature": 0.6, "max_tokens": n, "ignore_eos": True, "seed": i} for i, n in enumerate(out_lens)]
    return [Workload("w1-greedy", prompts, greedy, True), Workload("w1-t0.6", prompts, sampled, False)]


def w2_workload(name: str, num_seqs: int = 16, prefix_len: int = 256, suffix_min: int = 8, suffix_max: int = 24,
                output_len: int = 24) -> Workload:
    """W2: every request of a call shares one prefix (redrawn per call) plus its own short suffix; greedy."""
    rng = random.Random(2)
    suffixes = [[rng.randint(0, 10000) for _ in range(rng.randint(suffix_min, suffix_max))] for _ in range(num_seqs)]
    prompts = [[0] * prefix_len + s for s in suffixes]  # placeholder prefix: prompts_for draws the real one
    params = [{"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True, "seed": None}] * num_seqs
    return Workload(name, prompts, params, compare_tokens=True, fresh_prefix_len=prefix_len)


def w3_workload(num_seqs: int = 16, prompt_min: int = 16, prompt_max: int = 64, output_min: int = 64,
                output_max: int = 128) -> Workload:
    """W3: a batch whose KV need (~16 x 136 tokens at its peak) is far above the small pool it runs in."""
    rng = random.Random(3)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(prompt_min, prompt_max))] for _ in range(num_seqs)]
    params = [{"temperature": 0.0, "max_tokens": rng.randint(output_min, output_max), "ignore_eos": True,
               "seed": None} for _ in range(num_seqs)]
    return Workload("w3-preempt", prompts, params, compare_tokens=True)


def same_pool(pool_tokens: int, jaxpaged_page_size: int, vllm_block_size: int) -> tuple[int, int]:
    """(jaxpaged num_pages, vLLM num_gpu_blocks_override) holding exactly `pool_tokens` tokens each.

    jaxpaged's page 0 is its padding page and holds no tokens, so it gets one page more.
    """
    for size in (jaxpaged_page_size, vllm_block_size):
        if pool_tokens % size:
            raise ValueError(f"pool of {pool_tokens} tokens is not a whole number of {size}-token pages; "
                             f"pick a multiple of {jaxpaged_page_size * vllm_block_size}")
    return pool_tokens // jaxpaged_page_size + 1, pool_tokens // vllm_block_size


def compare_greedy(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Tokens equal before each prompt's first divergence, over the longer of the two outputs.

    After a divergence the two continuations condition on different histories, so only the common
    run before it counts as matching.
    """
    matching, total, identical, first_divergence = 0, 0, 0, []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        matching += same
        total += max(len(a), len(b))
        identical += a == b
        first_divergence.append(None if a == b else same)
    return {"matching_tokens": matching, "total_tokens": total, "match_fraction": matching / max(total, 1),
            "prompts_identical": identical, "num_prompts": len(ours), "first_divergence": first_divergence}


def prefix_hit_rate(prompts: list[list[int]], num_cached_tokens: list[int]) -> float:
    """Prompt tokens served from the prefix cache over all prompt tokens (both engines report
    `num_cached_tokens` per request, vLLM's name)."""
    if len(prompts) != len(num_cached_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(num_cached_tokens)} cached-token counts")
    return sum(num_cached_tokens) / max(1, sum(len(p) for p in prompts))


def compare_texts(ours: list[str | None], theirs: list[str | None]) -> dict:
    """Greedy cross-check of two servers' answers to the same requests, request by request: how many
    are identical, and where each other one first differs (a character index; None: identical).
    A request that failed on either side (None) counts as not identical."""
    first_divergence = []
    for a, b in zip(ours, theirs, strict=True):
        if a is None or b is None:
            first_divergence.append(0)
        elif a == b:
            first_divergence.append(None)
        else:
            first_divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    identical = sum(d is None for d in first_divergence)
    return {"identical": identical, "num_requests": len(ours), "first_divergence_char": first_divergence}
