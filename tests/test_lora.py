"""Multi-LoRA against Hugging Face + PEFT: adapters of different ranks and targets and the base model
mixed in one generate call through two device slots, each request's greedy tokens equal to PEFT's;
no compile while ten adapters rotate through the slots; prefix-cache isolation between adapters (and
between an adapter's old and replaced weights); bad adapters refused with the engine serving on.

One tiny random Llama checkpoint (tests/tiny_checkpoint.py); PEFT initializes lora_B to zero, so every
adapter's factors are drawn at random here (else an adapter would change nothing and prove nothing).
"""

import numpy as np
import pytest
from compile_watch import backend_compiles
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM, LoRARequest, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft_adapters import base_model, hf_greedy, write_adapters  # noqa: E402 (needs torch and peft)

ENGINE = dict(page_size=4, num_pages=128, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
              enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPTS = ["The quick brown fox", "Once upon a time", "hello there friend"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    """{name: (directory, the PEFT model as the oracle)}."""
    return write_adapters(ckpt, tmp_path_factory)


@pytest.mark.parametrize("per_layer_weights", [None, True])
def test_mixed_adapters_and_base_in_one_generate_equal_hf_peft(ckpt, adapters, per_layer_weights):
    """Three adapters (ranks 4, 8, 2; attention and MLP targets; rsLoRA) and the base model in one
    generate call with max_loras=2: the third adapter waits for a slot; every request's greedy tokens
    equal Hugging Face + PEFT's. per_layer_weights=True: the GPU's unrolled layers, one slot buffer per layer."""
    llm = LLM(ckpt, warmup=False, per_layer_weights=per_layer_weights, **ENGINE)
    assert llm.engine.runner.lora.per_layer == bool(per_layer_weights)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    requests = {name: LoRARequest(name, i + 1, directory) for i, (name, (directory, _)) in enumerate(adapters.items())}
    jobs = [(prompt, name) for prompt in PROMPTS for name in (None, *requests)]
    outputs = llm.generate([p for p, _ in jobs], GREEDY, lora_request=[requests.get(n) for _, n in jobs])
    base = base_model(ckpt)
    got = {}
    for (prompt, name), output in zip(jobs, outputs):
        oracle = base if name is None else adapters[name][1]
        want = hf_greedy(oracle, tokenizer, prompt, GREEDY.max_tokens)
        got[prompt, name] = output.outputs[0].token_ids
        assert got[prompt, name] == want, (prompt, name)
    for prompt in PROMPTS:  # each adapter changes the tokens (else the test would prove nothing)
        assert len({tuple(got[prompt, name]) for name in (None, *requests)}) == 4, prompt
    stats = llm.stats()
    assert stats["num_loras"] == 3 and stats["num_lora_slot_loads"] >= 3  # three adapters through two slots
    assert llm.list_loras() == {1, 2, 3}


def random_adapter_tensors(rng, rank: int, layers=2, hidden=64, kv=32):
    """A PEFT state dict (q_proj and v_proj of every layer) drawn at random, and its adapter config."""
    tensors = {}
    for layer in range(layers):
        for module, out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, hidden), np.float32) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out, rank), np.float32) * 0.3
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}


def test_ten_adapters_rotate_through_two_slots_without_compiling(ckpt):
    """After warm-up, ten adapters (in-memory tensors) run in turn through max_loras=2 slots: no XLA
    compile at all, every adapter's tokens are its own, and an adapter evicted and reloaded gives the
    same tokens as before."""
    llm = LLM(ckpt, **ENGINE)  # warm-up compiles every step program and the slot write
    engine = llm.engine
    rng = np.random.default_rng(0)
    requests = []
    for i in range(10):
        tensors, config = random_adapter_tensors(rng, rank=[2, 4, 8][i % 3])
        requests.append(LoRARequest(f"a{i}", i + 1, lora_tensors=tensors, lora_config=config))
    prompt = PROMPTS[0]
    llm.generate(prompt, GREEDY)  # the base model once (a fresh sampler row count, nothing adapter-specific)
    step_compiles = engine.runner.num_compiles
    with backend_compiles() as compiled:
        first = [llm.generate(prompt, GREEDY, lora_request=r)[0].outputs[0].token_ids for r in requests]
        again = llm.generate([prompt] * 2, GREEDY, lora_request=requests[:2])  # evicted long ago: reloaded
    assert compiled == []
    assert engine.runner.num_compiles == step_compiles
    assert engine.runner.lora.num_write_compiles == 1  # the one at warm-up
    assert engine.runner.lora.num_loads >= 12
    assert len({tuple(t) for t in first}) == 10
    assert [o.outputs[0].token_ids for o in again] == first[:2]


def test_prefix_cache_pages_never_cross_adapters(ckpt, adapters):
    """Pages computed under the base model or one adapter never serve another adapter (or the same
    adapter after its weights were replaced); the same adapter does hit its own pages."""
    directory = adapters["sql"][0]
    prompt = "a long shared prompt that fills several pages of four tokens each"
    fresh = LLM(ckpt, warmup=False, **ENGINE)
    want_sql = fresh.generate(prompt, GREEDY, lora_request=LoRARequest("sql", 1, directory))[0]
    want_poet = fresh.generate(prompt, GREEDY, lora_request=LoRARequest("poet", 2, adapters["poet"][0]))[0]
    want_base = fresh.generate(prompt, GREEDY)[0]

    llm = LLM(ckpt, warmup=False, **ENGINE)
    sql, poet = LoRARequest("sql", 1, directory), LoRARequest("poet", 2, adapters["poet"][0])
    base_out = llm.generate(prompt, GREEDY)[0]
    sql_out = llm.generate(prompt, GREEDY, lora_request=sql)[0]
    assert sql_out.num_cached_tokens == 0  # the base model's pages are not the adapter's
    poet_out = llm.generate(prompt, GREEDY, lora_request=poet)[0]
    assert poet_out.num_cached_tokens == 0
    sql_again = llm.generate(prompt, GREEDY, lora_request=sql)[0]
    assert sql_again.num_cached_tokens > 0  # its own pages
    base_again = llm.generate(prompt, GREEDY)[0]
    assert base_again.num_cached_tokens > 0
    for got, want in ((base_out, want_base), (sql_out, want_sql), (poet_out, want_poet), (sql_again, want_sql),
                      (base_again, want_base)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # The adapter's weights replaced in place (same name and id): its old pages never serve it again.
    llm.add_lora(LoRARequest("sql", 1, adapters["poet"][0]))  # poet's weights as "sql"
    replaced = llm.generate(prompt, GREEDY, lora_request=sql)[0]
    assert replaced.num_cached_tokens == 0
    assert replaced.outputs[0].token_ids == want_poet.outputs[0].token_ids
    # A request queued before a replacement takes the new version into its salt too.
    engine = llm.engine
    engine.add_request(engine.tokenizer.encode(prompt), GREEDY, lora_request=sql, request_id="queued")
    assert engine.scheduler.waiting[-1].cache_salt[2] == (1, 1)
    llm.add_lora(LoRARequest("sql", 1, directory))
    assert engine.scheduler.waiting[-1].cache_salt[2] == (1, 2)
    engine.abort_request("queued")


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(ckpt, adapters, tmp_path):
    llm = LLM(ckpt, warmup=False, **dict(ENGINE, max_lora_rank=4))
    rng = np.random.default_rng(1)
    tensors, config = random_adapter_tensors(rng, rank=4)
    with pytest.raises(ValueError, match="rank 8 .*max_lora_rank=4"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("poet", 1, adapters["poet"][0]))
    bad_target = dict(tensors)
    bad_target["base_model.model.model.embed_tokens.lora_A.weight"] = np.zeros((4, 320), np.float32)
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("emb", 2, lora_tensors=bad_target, lora_config=config))
    unknown = {k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items()}
    with pytest.raises(ValueError, match="unknown target module 'qkv_proj'"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("fused", 3, lora_tensors=unknown, lora_config=config))
    wrong_shape = {k: (v[:, :32] if k.endswith("lora_A.weight") else v) for k, v in tensors.items()}
    with pytest.raises(ValueError, match="trained for another model"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("shape", 4, lora_tensors=wrong_shape, lora_config=config))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("none", 5, str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="DoRA"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("dora", 6, lora_tensors=tensors,
                                                             lora_config=dict(config, use_dora=True)))
    assert llm.stats()["num_requests"] == 0 and llm.list_loras() == set()
    good = LoRARequest("good", 7, lora_tensors=tensors, lora_config=config)
    assert len(llm.generate(["hi", "there"], GREEDY, lora_request=good)) == 2  # still serving
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(ckpt, warmup=False, max_model_len=64).generate("hi", GREEDY, lora_request=good)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_adapters_survive_preemption_and_n_samples(ckpt, adapters, preemption_mode):
    """A pool too small for the batch: sequences under different adapters are preempted (recomputed or
    swapped) and readmitted, and n=2 samples fork under their parent's adapter; every greedy sample
    still equals Hugging Face + PEFT's."""
    swap = dict(swap_space_bytes=1 << 20) if preemption_mode == "swap" else {}
    llm = LLM(ckpt, warmup=False, **dict(ENGINE, num_pages=16, preemption_mode=preemption_mode, **swap))
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    requests = {"sql": LoRARequest("sql", 1, adapters["sql"][0]), "poet": LoRARequest("poet", 2, adapters["poet"][0])}
    jobs = [(PROMPTS[0], "sql"), (PROMPTS[1], "poet"), (PROMPTS[2], None), (PROMPTS[1], "sql")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    outputs = llm.generate([p for p, _ in jobs], params, lora_request=[requests.get(n) for _, n in jobs])
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and (stats["num_swaps_out"] > 0) == (preemption_mode == "swap")
    for (prompt, name), output in zip(jobs, outputs):
        want = hf_greedy(base_model(ckpt) if name is None else adapters[name][1], tokenizer, prompt, 8)
        assert [c.token_ids for c in output.outputs] == [want, want], (prompt, name)


def test_beam_search_under_an_adapter_equals_hf_peft(ckpt, adapters):
    from jaxpaged import BeamSearchParams

    llm = LLM(ckpt, warmup=False, **ENGINE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    params = BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True)
    lora = LoRARequest("poet", 2, adapters["poet"][0])
    out = llm.beam_search([PROMPTS[0]], params, lora_request=lora)[0]
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        hf = adapters["poet"][1].generate(input_ids=ids, num_beams=2, num_return_sequences=2, do_sample=False,
                                          max_new_tokens=5, min_new_tokens=5, early_stopping=False, length_penalty=1.0,
                                          pad_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
    assert [b.token_ids for b in out.beams] == [row[ids.shape[1]:].tolist() for row in hf]
    base = llm.beam_search([PROMPTS[0]], params)[0]
    assert [b.token_ids for b in base.beams] != [b.token_ids for b in out.beams]  # the adapter mattered


def test_chat_and_stream_pass_the_adapter_through(ckpt, adapters):
    llm = LLM(ckpt, warmup=False, **ENGINE)
    sql = LoRARequest("sql", 1, adapters["sql"][0])
    messages = [{"role": "user", "content": "hi there"}]
    text = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False)}, GREEDY,
                        lora_request=sql)[0].outputs[0].token_ids
    assert want != llm.generate(text, GREEDY)[0].outputs[0].token_ids  # the adapter matters for this prompt
    assert llm.chat(messages, GREEDY, lora_request=sql)[0].outputs[0].token_ids == want
    streamed = [o for o in llm.stream(PROMPTS[0], GREEDY, lora_request=sql)][-1].outputs[0].token_ids
    assert streamed == llm.generate(PROMPTS[0], GREEDY, lora_request=sql)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=[sql, sql])
    with pytest.raises(ValueError, match="is adapter 'sql'"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("other", 1, adapters["poet"][0]))


def test_what_lora_refuses_by_name(ckpt, adapters):
    from jaxpaged import EngineConfig
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.peft_adapter import load_adapter

    with pytest.raises(ValueError, match="enable_lora=True does not run with speculative_config"):
        EngineConfig(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be >= max_loras=2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    moe = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    tensors = {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": np.zeros((2, 64), np.float32),
               "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": np.zeros((32, 2), np.float32)}
    with pytest.raises(ValueError, match="MoE experts' MLP adapters are not served"):
        load_adapter(LoRARequest("moe", 1, lora_tensors=tensors, lora_config={"r": 2}), moe, 8)
    llm = LLM(ckpt, warmup=False, **ENGINE)
    sql = LoRARequest("sql", 1, adapters["sql"][0])
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), lora_request=sql)
    next(stream)  # the request runs under sql
    with pytest.raises(ValueError, match="has unfinished requests"):
        llm.remove_lora(1)
    stream.close()
    assert llm.remove_lora(1) and llm.list_loras() == set() and not llm.remove_lora(1)
