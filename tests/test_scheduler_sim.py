"""500 requests through the scheduler with a fake model, on a pool small enough to force preemption.

The fake model's next token is a function of the context it reads back through the block table from
a fake KV pool (test_host_stateful.FakeKVPool), so any paging mistake (a bad prefix-cache hit, a lost
page after preemption, a shared page written) changes the outputs. The oracle is the same function
iterated on each prompt alone, i.e. an unconstrained run.
"""

import random

import pytest

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from test_host_stateful import FakeKVPool, registered

PAGE_SIZE = 4
NUM_PAGES = 41  # 160 token slots for up to 16 sequences of up to 96 tokens: preemption is certain
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 48
MAX_MODEL_LEN = 96
NUM_REQUESTS = 500


def next_token(context):
    """The fake model: deterministic in the whole context, never the eos id 0."""
    return (sum((idx + 1) * token_id for idx, token_id in enumerate(context)) * 31 + len(context)) % 997 + 1


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_requests(seed):
    rng = random.Random(seed)
    shared_prefixes = [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    requests = []
    for _ in range(NUM_REQUESTS):
        prompt = rng.choice(shared_prefixes) if rng.random() < 0.4 else []
        prompt = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        max_tokens = rng.randrange(1, min(40, MAX_MODEL_LEN - len(prompt)) + 1)
        requests.append((prompt, max_tokens))
    return requests


def run(requests, enable_prefix_caching):
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, enable_prefix_caching=enable_prefix_caching)
    sched = Scheduler(bm, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN)
    pool = FakeKVPool(NUM_PAGES, PAGE_SIZE, bm)
    seqs = [Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0)
            for prompt, max_tokens in requests]
    arrivals = iter(seqs)
    num_steps = 0
    while sched.has_unfinished() or num_steps == 0:
        for seq in [next(arrivals, None) for _ in range(3)]:  # requests keep arriving while others run
            if seq is not None:
                sched.add(seq)
        registered_before = registered(bm)
        out = sched.schedule()
        assert 1 <= out.num_batched_tokens <= MAX_NUM_BATCHED_TOKENS
        assert len(out.seqs) <= MAX_NUM_SEQS and min(out.num_new_tokens) >= 1
        pool.run(out, registered_before)
        sampled = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            num_context = seq.num_computed_tokens + num_new
            sampled.append(next_token(pool.context(seq, num_context)) if num_context == len(seq.token_ids) else -1)
        sched.update(out, sampled)
        num_steps += 1
        assert num_steps < 20_000, "no progress"
    return bm, sched, seqs


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_500_requests_under_memory_pressure_match_an_unconstrained_run(enable_prefix_caching):
    requests = make_requests(seed=0)
    bm, sched, seqs = run(requests, enable_prefix_caching)
    for seq, (prompt, max_tokens) in zip(seqs, requests):
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert seq.output_token_ids == expected_output(prompt, max_tokens), seq
    assert sched.num_preemptions > 0 and sched.num_recomputed_tokens > 0
    stats = bm.stats()
    assert stats["num_used_pages"] == 0 and bm.ref_counts == [0] * NUM_PAGES
    assert sorted(bm.free_page_ids) == list(range(1, NUM_PAGES))
    if enable_prefix_caching:
        assert stats["prefix_hit_tokens"] > 0 and stats["num_evictions"] > 0
    else:
        assert stats["prefix_hit_tokens"] == 0 and stats["num_cached_pages"] == 0
