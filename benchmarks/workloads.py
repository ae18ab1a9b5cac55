"""The benchmark workloads of BENCHMARKS.md (W1-W3 and their variants), as lists of requests.

Each workload is (prompt token ids, SamplingParams) pairs drawn with a fixed seed, so every system
of a run, and every run, serves exactly the same requests. `PRESETS` sizes them per machine.
"""

from __future__ import annotations

import dataclasses
import random

from jaxpaged.planner.request import SamplingParams

Request = tuple[list[int], SamplingParams]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_budget_tokens: int | None  # None: from free device memory (jaxpaged's own rule)
    w1: dict  # num_seqs, min_len, max_len (prompt and output lengths), temperature
    w2: dict  # num_seqs, prefix_len, suffix_min, suffix_max, output_len
    w3: dict  # num_seqs, prompt range, output range, kv_budget_tokens
    hf_peer: bool
    w2_host: dict | None = None  # num_prefixes, num_seqs, prefix_len, suffix_len, output_len, kv_budget_tokens


PRESETS = {
    # The bundled SmolLM2-135M on 2 CPU cores: W1 scaled down as BENCHMARKS.md suggests. The KV
    # budget holds 8 rows of max_model_len for the dense design, while jaxpaged fits every sequence.
    "cpu": Preset(
        name="cpu", page_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
        kv_budget_tokens=8 * 256,
        w1=dict(num_seqs=16, min_len=16, max_len=64, temperature=0.6),
        w2=dict(num_seqs=8, prefix_len=192, suffix_min=4, suffix_max=16, output_len=16),
        w3=dict(num_seqs=6, prompt_min=16, prompt_max=48, output_min=24, output_max=64, kv_budget_tokens=256),
        hf_peer=True,
        # 4 prefixes of 192 tokens (48 pages) against 28 pages: about two requests fit at once.
        w2_host=dict(num_prefixes=4, num_seqs=12, prefix_len=192, suffix_len=8, output_len=8, kv_budget_tokens=448),
    ),
    # BENCHMARKS.md W1 exactly: 256 sequences, lengths in [100, 1024], max_model_len 4096.
    "h100": Preset(
        name="h100", page_size=16, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
        kv_budget_tokens=None,
        w1=dict(num_seqs=256, min_len=100, max_len=1024, temperature=0.6),
        w2=dict(num_seqs=128, prefix_len=1024, suffix_min=16, suffix_max=64, output_len=128),
        w3=dict(num_seqs=64, prompt_min=100, prompt_max=512, output_min=256, output_max=512,
                kv_budget_tokens=16 * 1024),
        hf_peer=False,
    ),
}

QWEN3_0_6B_SHAPES = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
    max_position_embeddings=40960, dtype="bfloat16",
)


# ----------------------------------------------------------------------------- workloads


def workload_w1(num_seqs: int, min_len: int, max_len: int, temperature: float) -> list[Request]:
    """BENCHMARKS.md W1 (nano-vllm's bench): random.seed(0), prompt ids in [0, 10000), ignore_eos."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    return [
        (p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(min_len, max_len),
                           seed=i))
        for i, p in enumerate(prompts)
    ]


def workload_w2(num_seqs, prefix_len, suffix_min, suffix_max, output_len, *, shared: bool) -> list[Request]:
    """A common prefix (a few-shot prompt) with short distinct suffixes; `shared=False`: every prefix differs."""
    rng = random.Random(1)
    common = [rng.randint(0, 10000) for _ in range(prefix_len)]
    requests = []
    for _ in range(num_seqs):
        prefix = common if shared else [rng.randint(0, 10000) for _ in range(prefix_len)]
        suffix = [rng.randint(0, 10000) for _ in range(rng.randint(suffix_min, suffix_max))]
        requests.append((prefix + suffix, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)))
    return requests


def workload_w3(num_seqs, prompt_min, prompt_max, output_min, output_max, **_) -> list[Request]:
    rng = random.Random(3)
    return [
        ([rng.randint(0, 10000) for _ in range(rng.randint(prompt_min, prompt_max))],
         SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(output_min, output_max)))
        for _ in range(num_seqs)
    ]


def workload_w2_host(num_prefixes, num_seqs, prefix_len, suffix_len, output_len) -> list[Request]:
    """Requests cycling through `num_prefixes` shared prefixes: a prefix comes back only after the
    others have pushed it out of a pool that holds fewer than `num_prefixes` of them."""
    rng = random.Random(2)
    prefixes = [[rng.randint(0, 10000) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        (prefixes[i % num_prefixes] + [rng.randint(0, 10000) for _ in range(suffix_len)],
         SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len))
        for i in range(num_seqs)
    ]


# ----------------------------------------------------------------------------- systems


class SilentTokenizer:
    """For random-weight models: token ids only, no text (the engine's detokenizer does nothing)."""

    eos_token_id = None

    class _Detokenizer:
        def __getattr__(self, name):
            return lambda *args, **kwargs: ""

    def detokenizer(self, *args, **kwargs):
        return self._Detokenizer()

    incremental_detokenizer = detokenizer
