"""Weights that change under running requests (RL loops): update_params with in_flight
"keep" / "recompute" / "abort", per-token weight versions, the prefix cache across versions,
and sleep / wake_up. Tiny random model (tests/tp_fixtures.py), greedy decoding throughout.

Oracles: a fresh engine on the new weights started from the same committed tokens (exact greedy
tokens); for "keep" the new weights differ only in lm_head, which K/V do not depend on, so keeping
the old K/V must give exactly the fresh run's tokens too.
"""

import jax
import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.planner.prefix_cache import hash_page, versioned_salt
from jaxpaged.planner.request import SamplingParams
from tests.tp_fixtures import make_engine, prompts, tiny_params

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _scaled(params, names=None, factor=-1.5):
    """params with the leaves whose last key is in `names` (all matrices if None) scaled."""
    def scale(path, x):
        name = getattr(path[-1], "key", None)
        hit = (np.ndim(x) >= 2) if names is None else name in names
        return np.asarray(x) * factor if hit else np.asarray(x)
    return jax.tree_util.tree_map_with_path(scale, params)


def _greedy(engine, prompt, max_tokens):
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final.outputs[0]


def _run_until(engine, prompt, num_tokens, max_tokens):
    """Adds a request and steps until it has >= num_tokens known tokens; returns its id."""
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    have = 0
    while have < num_tokens:
        for out in engine.step():
            have = len(out.outputs[0].token_ids)
    return request_id


def _finish(engine):
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    return final


def _assert_clean(engine):
    stats = engine.stats()
    assert stats["num_used_pages"] == 0, stats
    assert not engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def params():
    return tiny_params()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_keep_continues_on_old_kv_and_records_versions(params, async_scheduling):
    prompt = prompts()[3]  # 9 tokens
    new = _scaled(params, {"lm_head"})  # K/V do not depend on lm_head: the exact oracle below
    engine = make_engine(params, async_scheduling=async_scheduling)
    old_only = _greedy(engine, prompt, 12).token_ids
    compiles = engine.stats()["num_compiles"]
    request_id = _run_until(engine, prompt, 4, 12)
    engine.update_params(new, version=7, in_flight="keep")
    out = _finish(engine)[request_id].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    k = out.weight_versions.count(0)
    assert out.weight_versions == [0] * k + [7] * (12 - k) and 4 <= k < 12
    assert out.token_ids[:k] == old_only[:k]
    fresh = make_engine(new, async_scheduling=async_scheduling)
    assert out.token_ids[k:] == _greedy(fresh, prompt + out.token_ids[:k], 12 - k).token_ids
    assert out.token_ids != old_only  # the update changed something
    assert engine.stats()["num_compiles"] == compiles and engine.stats()["weight_version"] == 7
    _assert_clean(engine)


def test_recompute_equals_a_fresh_run_from_the_committed_tokens(params):
    prompt = prompts()[4]  # 23 tokens: > one 16-token budget
    new = _scaled(params)  # every matrix: the old K/V are wrong under the new weights
    engine = make_engine(params)
    old_only = _greedy(engine, prompt, 14).token_ids
    compiles = engine.stats()["num_compiles"]
    request_id = _run_until(engine, prompt, 3, 14)
    recomputed_before = engine.stats()["num_recomputed_tokens"]
    engine.update_params(new, in_flight="recompute")  # version: 0 + 1
    out = _finish(engine)[request_id].outputs[0]
    k = out.weight_versions.count(0)
    assert out.weight_versions == [0] * k + [1] * (14 - k) and 3 <= k < 14
    assert out.token_ids[:k] == old_only[:k]
    fresh = make_engine(new)
    assert out.token_ids[k:] == _greedy(fresh, prompt + out.token_ids[:k], 14 - k).token_ids
    # ... and "keep" on the same update does not (its K/V come from the old weights).
    keep = make_engine(params)
    keep_id = _run_until(keep, prompt, 3, 14)
    keep.update_params(new, in_flight="keep")
    kept = _finish(keep)[keep_id].outputs[0]
    assert kept.token_ids[:k] == out.token_ids[:k] and kept.token_ids != out.token_ids
    assert engine.stats()["num_recomputed_tokens"] > recomputed_before
    assert engine.stats()["num_compiles"] == compiles
    _assert_clean(engine)


def test_abort_finishes_running_requests_and_the_engine_serves_on(params):
    engine = make_engine(params)
    a = _run_until(engine, prompts()[3], 3, 20)
    b = engine.add_request(prompts()[1], SamplingParams(max_tokens=20, n=2, **GREEDY))  # waiting or just started
    engine.update_params(_scaled(params), in_flight="abort")
    assert engine.has_request(a) and engine.has_request(b)  # their final outputs are still to come
    final = _finish(engine)
    assert set(final) == {a, b}
    for request_id in (a, b):
        for completion in final[request_id].outputs:
            assert completion.finish_reason == "abort"
            assert completion.weight_versions == [0] * len(completion.token_ids)
    _assert_clean(engine)
    out = _greedy(engine, prompts()[2], 5)
    assert out.weight_versions == [1] * 5
    assert out.token_ids == _greedy(make_engine(_scaled(params)), prompts()[2], 5).token_ids
    _assert_clean(engine)


def test_prefix_cache_never_serves_pages_across_versions(params):
    """A request still prefilling across a "keep" update registers its pages under the old epoch:
    a request with the same prompt admitted after the update must not hit them."""
    prompt = np.random.default_rng(1).integers(0, 256, 40).tolist()  # 5 pages; prefilled over 3 steps
    new = _scaled(params)
    engine = make_engine(params)
    first = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # 16 of its 40 prompt tokens
    engine.update_params(new, in_flight="keep")
    second = _finish(engine)  # the first fills and registers its pages 2..4 (old-epoch K/V) here
    assert first in second
    out = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    result = _finish(engine)[out]
    assert result.num_cached_tokens == 0
    assert result.outputs[0].token_ids == _greedy(make_engine(new), prompt, 4).token_ids
    # Pages computed under the new weights are served to the next request of that epoch.
    again = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    result_again = _finish(engine)[again]
    assert result_again.num_cached_tokens == 32
    assert result_again.outputs[0].token_ids == result.outputs[0].token_ids
    _assert_clean(engine)


def test_a_reused_version_label_never_serves_pages_of_the_old_weights(params):
    """Two updates both labelled version 1 (different weights): a request waiting at the second
    update, and one added after it, must not hit the pages the first request computed under the
    first version-1 weights (the prefix cache keys on the internal epoch, not the label)."""
    prompt = np.random.default_rng(2).integers(0, 256, 40).tolist()
    first_weights, second_weights = _scaled(params), _scaled(params, factor=0.5)
    engine = make_engine(params)
    engine.update_params(first_weights, version=1)
    engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.step()  # the first request prefills 16 tokens under the first version-1 weights
    waiting = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    engine.update_params(second_weights, version=1, in_flight="keep")
    after = engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    final = _finish(engine)
    expected = _greedy(make_engine(second_weights), prompt, 4).token_ids
    assert final[waiting].num_cached_tokens == 0  # `after` may hit the pages `waiting` computed
    for request_id in (waiting, after):
        assert final[request_id].outputs[0].token_ids == expected
        assert final[request_id].outputs[0].weight_versions == [1] * 4
    _assert_clean(engine)


def test_recompute_update_keeps_arrival_order(params):
    """in_flight="recompute" with three running requests: they go back to the waiting queue in
    arrival order (the scheduler's invariant), so they are readmitted oldest first."""
    engine = make_engine(params)
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts()[1:4]]
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 3 and not engine.scheduler.waiting
    engine.update_params(_scaled(params), in_flight="recompute")
    order = [seq.arrival_idx for seq in engine.scheduler.waiting]
    assert len(order) == 3 and order == sorted(order)
    final = _finish(engine)
    assert set(final) == set(ids)
    _assert_clean(engine)


def test_versioned_salt_separates_epochs_and_keeps_the_tenant():
    tokens = (1, 2, 3, 4)
    assert versioned_salt(None, 0) is None and versioned_salt("t", 0) == "t"
    assert versioned_salt(versioned_salt("t", 1), 2) == ("t", 2)
    digests = {hash_page(None, s, tokens) for s in (None, "t", (None, 1), ("t", 1), ("t", 2))}
    assert len(digests) == 5


def test_update_params_rejects_bad_input_and_changes_nothing(params):
    engine = make_engine(params)
    with pytest.raises(ValueError, match="in_flight"):
        engine.update_params(params, in_flight="later")
    with pytest.raises(ValueError, match="version"):
        engine.update_params(params, version=True)  # a bool is not a version
    bad = jax.tree.map(lambda x: x[:1] if np.ndim(x) == 2 else x, params)
    with pytest.raises(ValueError, match="shape"):
        engine.update_params(bad)
    assert engine.stats()["weight_version"] == 0


def _live_bytes():
    return sum(x.nbytes for x in jax.live_arrays())


def test_sleep_frees_device_memory_and_wake_up_restores_outputs(params):
    engine = make_engine(params)
    prompt = prompts()[4]
    before = _greedy(engine, prompt, 8).token_ids
    compiles = engine.stats()["num_compiles"]
    pool = engine.runner.kv_cache_bytes()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))

    live = _live_bytes()
    engine.sleep(level=1)
    assert live - _live_bytes() >= pool + weight_bytes  # weights moved to the host (numpy)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.wake_up()
    assert _greedy(engine, prompt, 8).token_ids == before

    live = _live_bytes()
    engine.sleep(level=2)
    assert live - _live_bytes() >= pool + weight_bytes
    engine.wake_up()
    with pytest.raises(RuntimeError, match="update_params"):
        engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.update_params(params, version=0)
    assert _greedy(engine, prompt, 8).token_ids == before
    assert engine.stats()["num_compiles"] == compiles
    _assert_clean(engine)

    engine.add_request(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="finish or abort"):
        engine.sleep(level=1)
    _finish(engine)


def test_update_params_while_asleep_at_level_2_then_wake_up(params):
    """Level 2 then update_params while asleep: the weights arrive on the device, the pool at wake_up."""
    engine = make_engine(params)
    before = _greedy(engine, prompts()[2], 6).token_ids
    engine.sleep(level=2)
    engine.update_params(params)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.add_request(prompts()[2], SamplingParams(max_tokens=2))
    engine.wake_up()
    assert _greedy(engine, prompts()[2], 6).token_ids == before


def test_llm_update_mid_stream(params):
    """Through LLM: a stream half-read, update_params (keep), the stream finishes on the new version."""
    llm = LLM.from_engine(make_engine(params))
    stream = llm.stream([prompts()[3]], SamplingParams(max_tokens=10, **GREEDY))
    first = next(stream)
    llm.update_params(_scaled(params, {"lm_head"}), version=3)
    *_, last = stream
    versions = last.outputs[0].weight_versions
    assert versions[0] == 0 and versions[-1] == 3 and len(versions) == 10 and first.outputs[0].weight_versions[0] == 0
    assert llm.stats()["num_used_pages"] == 0


def test_data_parallel_engine_updates_sleeps_and_wakes_every_replica(params):
    """Two replicas (on the one CPU device): the new EngineClient members reach both."""
    from jaxpaged.engine.data_parallel import DataParallelEngine

    engine = DataParallelEngine([make_engine(params), make_engine(params)])
    ids = [engine.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts()[2:4]]
    engine.step(), engine.step()
    engine.update_params(_scaled(params), version=5, in_flight="abort")
    final = _finish(engine)
    assert set(final) == set(ids) and all(final[i].outputs[0].finish_reason == "abort" for i in ids)
    with pytest.raises(ValueError, match="finish or abort"):
        engine.add_request(prompts()[1], SamplingParams(max_tokens=2)), engine.sleep(level=1)
    _finish(engine)
    engine.sleep(level=1)
    assert all(e.stats()["sleep_level"] == 1 for e in engine.engines)
    engine.wake_up()
    outs = [_greedy(engine, p, 4) for p in prompts()[2:4]]
    assert all(o.weight_versions == [5] * 4 for o in outs)
    assert engine.stats()["num_used_pages"] == 0


def test_llm_sleep_modes_and_wake_up_tags_as_vllm(params):
    """vLLM's LLM.sleep(level, mode) / wake_up(tags) -> True: "wait" finishes a half-read stream
    first (its outputs still reach it), "abort" ends it (pages freed); "keep" and level 0 are refused."""
    llm = LLM.from_engine(make_engine(params))
    expected = llm.generate([prompts()[3]], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0].token_ids
    for bad in (dict(level=0), dict(mode="keep")):
        with pytest.raises(ValueError, match="not supported"):
            llm.sleep(**bad)
    stream = llm.stream([prompts()[3]], SamplingParams(max_tokens=6, **GREEDY))
    next(stream)
    llm.sleep(level=1, mode="wait")
    assert llm.stats()["sleep_level"] == 1 and llm.stats()["num_used_pages"] == 0
    *_, last = stream  # its remaining outputs were kept for it
    assert last.outputs[0].token_ids == expected and last.finished
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(tags=["everything"])
    assert llm.wake_up(tags=["weights"]) is True and llm.wake_up(tags=["kv_cache"]) is True
    assert llm.stats()["sleep_level"] == 0

    stream = llm.stream([prompts()[3]], SamplingParams(max_tokens=6, **GREEDY))
    next(stream)
    llm.sleep(level=1)  # mode="abort"
    assert llm.stats()["num_used_pages"] == 0 and llm.stats()["num_requests"] == 0
    with pytest.raises(RuntimeError, match=r"aborted outside this call \(LLM.sleep\(mode='abort'\)\)"):
        next(stream)
    assert llm.wake_up() is True
    assert llm.generate([prompts()[3]], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0].token_ids == expected
    # A request added to the engine directly is not this LLM's to abort: refused before anything
    # changes; "wait" runs it to the end.
    llm.engine.add_request(prompts()[2], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(ValueError, match="mode='wait'"):
        llm.sleep()
    llm.sleep(mode="wait")
    assert llm.stats()["num_requests"] == 0 and llm.stats()["sleep_level"] == 1
    llm.wake_up()


def test_load_weights_takes_a_hugging_face_state_dict_as_vllm(tmp_path):
    """A torch trainer's state_dict (HF names and layout) into a running LLM: its greedy tokens
    then equal those of an LLM loaded from a checkpoint holding those weights."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file
    from tiny_checkpoint import write_tiny_checkpoint
    from jaxpaged.models.loading import load_safetensors_dir

    source = write_tiny_checkpoint(str(tmp_path / "a"))
    state = load_safetensors_dir(source)
    scaled = {name: (w * 0.7 if w.ndim == 2 else w) for name, w in state.items()}
    target = write_tiny_checkpoint(str(tmp_path / "b"))
    for path in (tmp_path / "b").glob("*.safetensors"):
        path.unlink()
    save_file({k: np.ascontiguousarray(v) for k, v in scaled.items()}, str(tmp_path / "b" / "model.safetensors"))
    engine_args = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=8, warmup=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = LLM(target, **engine_args).generate("hello there", greedy)[0].outputs[0].token_ids
    llm = LLM(source, **engine_args)
    before = llm.generate("hello there", greedy)[0].outputs[0].token_ids
    llm.load_weights((name, torch.from_numpy(np.ascontiguousarray(w))) for name, w in scaled.items())
    assert llm.generate("hello there", greedy)[0].outputs[0].token_ids == want != before
    with pytest.raises(ValueError, match="every weight.*lm_head.weight"):
        llm.load_weights({k: v for k, v in scaled.items() if k != "lm_head.weight"})
