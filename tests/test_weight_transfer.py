"""Weight sync across processes without disk or pickle (entrypoints/weight_transfer.py, backend
"jax_transfer"): a trainer subprocess on 127.0.0.1 pushes changed weights into a running server's
in-process engine through vLLM's routes; after the sync the engine's greedy tokens equal those of a
reference engine built from the new weights. Also the offline `LLM` methods with a jaxpaged
parameter tree (kind "params"), and the refusals."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM, SamplingParams
from jaxpaged.rl import HTTPWeightSyncClient, TrainerWeightTransfer, leaves_by_path
from serve_fixtures import running_server
from weight_trainer import changed, checkpoint_weights

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

MODEL = "tiny"
PROMPTS = ["The weights of a policy", "A trainer pushes"]
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=96,
                   warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))


def greedy_tokens(llm):
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def served_greedy_tokens(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    tokens = []
    for prompt in PROMPTS:
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens.append(response.choices[0].model_extra["token_ids"])
    return tokens, response.model_extra.get("weight_version")


def test_a_trainer_process_pushes_weights_into_a_running_server(checkpoint, monkeypatch):
    reference = LLM(checkpoint, **ENGINE_ARGS)
    before = greedy_tokens(reference)
    reference.load_weights({name: changed(name, array) for name, array in checkpoint_weights(checkpoint).items()})
    expected = greedy_tokens(reference)
    assert expected != before  # the change is visible in the greedy tokens, so the check below can fail

    llm = LLM(checkpoint, **ENGINE_ARGS)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with running_server(llm.engine, served_model_name=MODEL) as (base, bridge):
        assert served_greedy_tokens(base)[0] == before
        client = HTTPWeightSyncClient(base)
        with pytest.raises(RuntimeError, match="HTTP 400.*start_weight_update"):
            client.update_weights({"update_info": {"uuid": 1, "names": ["x"], "dtype_names": ["float32"],
                                                   "shapes": [[2]]}})
        with pytest.raises(RuntimeError, match="HTTP 400.*'nccl' is not supported"):
            client.init_weight_transfer_engine({"init_info": {"trainer_address": "127.0.0.1:1", "backend": "nccl"}})
        # A pull that never gets its bytes (nobody offered this uuid): 502 after timeout_s, nothing staged,
        # and the engine serves on.
        stray = TrainerWeightTransfer("127.0.0.1:0")
        client.init_weight_transfer_engine({"init_info": {**stray.init_info(), "timeout_s": 1}})
        client.start_weight_update()
        with pytest.raises(RuntimeError, match="HTTP 502.*no bytes within timeout_s=1"):
            client.update_weights({"update_info": {"uuid": 7, "names": ["x"], "dtype_names": ["float32"],
                                                   "shapes": [[2]]}})
        with pytest.raises(RuntimeError, match="HTTP 400.*nothing staged"):
            client.finish_weight_update()
        assert served_greedy_tokens(base)[0] == before
        trainer = subprocess.run(
            [sys.executable, "-m", "tests.weight_trainer", checkpoint, base, "trained-1"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
            cwd=os.path.dirname(os.path.dirname(__file__)))  # this checkout's jaxpaged
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        num_bytes = sum(a.nbytes for a in checkpoint_weights(checkpoint).values())
        assert f"sent {num_bytes} bytes" in trainer.stdout  # every tensor, in chunks of 64 KiB
        tokens, version = served_greedy_tokens(base)
        assert tokens == expected and version == "trained-1"
        assert not bridge.paused and llm.engine.weight_version == "trained-1"


def test_the_offline_llm_pulls_a_parameter_tree_from_a_trainer(checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    new_params = jax.tree_util.tree_map(lambda x: jnp.roll(x, 1, axis=-1) * 1.25 + 0.01, llm.params)
    reference = LLM(checkpoint, **ENGINE_ARGS)
    reference.update_params(new_params)
    expected = greedy_tokens(reference)
    assert expected != greedy_tokens(llm)

    sender = TrainerWeightTransfer("127.0.0.1:0")  # its own transfer server: the bytes cross a socket
    llm.init_weight_transfer_engine({"init_info": sender.init_info()})
    leaves = leaves_by_path(new_params)
    names = list(leaves)
    half = len(names) // 2
    llm.start_weight_update()
    for chunk in (names[:half], names[half:]):  # two chunks merge until finish
        llm.update_weights({"update_info": sender.offer({n: leaves[n] for n in chunk}, kind="params")})
    llm.finish_weight_update(weight_version="step-1")
    assert greedy_tokens(llm) == expected and llm.get_weight_version() == "step-1"
    for got, want in zip(jax.tree_util.tree_leaves(llm.params), jax.tree_util.tree_leaves(new_params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # bit for bit


def test_refusals_name_what_to_do(checkpoint):
    llm = LLM(checkpoint, **ENGINE_ARGS)
    sender = TrainerWeightTransfer("127.0.0.1:0")
    llm.start_weight_update()
    with pytest.raises(ValueError, match="init_weight_transfer_engine"):
        llm.update_weights({"update_info": {"uuid": 1, "names": ["x"], "dtype_names": ["float32"], "shapes": [[2]]}})
    with pytest.raises(ValueError, match="nothing staged"):  # and the update is closed
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="backend 'nccl' is not supported"):
        llm.init_weight_transfer_engine({"init_info": {"trainer_address": sender.address, "backend": "nccl"}})
    with pytest.raises(ValueError, match="host:port"):
        llm.init_weight_transfer_engine({"init_info": {"trainer_address": "nowhere"}})
    llm.init_weight_transfer_engine({"init_info": {**sender.init_info(), "timeout_s": 5}})
    llm.start_weight_update()
    with pytest.raises(ValueError, match="same length"):
        llm.update_weights({"update_info": {"uuid": 1, "names": ["a", "b"], "dtype_names": ["float32"],
                                            "shapes": [[2]]}})
    with pytest.raises(ValueError, match="not a dtype name"):
        llm.update_weights({"update_info": {"uuid": 1, "names": ["a"], "dtype_names": ["float99"], "shapes": [[2]]}})
    offered = sender.offer({"a": jnp.ones((3,))})
    with pytest.raises(RuntimeError, match="failed"):  # other shapes than offered: the pull fails, fast
        llm.update_weights({"update_info": {**offered, "shapes": [[4]]}})
    leaves = leaves_by_path(llm.params)
    some = dict(list(leaves.items())[:2])
    llm.update_weights({"update_info": sender.offer(some, kind="params")})
    with pytest.raises(ValueError, match="every leaf"):  # a partial tree: nothing applied
        llm.finish_weight_update()
    assert llm.get_weight_version() == "0"
    assert greedy_tokens(llm)  # the engine serves on


def test_a_process_exits_cleanly_right_after_a_pull_timed_out():
    """A timed-out pull is failed and settled before `update_weights` raises: a runtime thread still
    blocked on it when the process exits would abort it (status 134)."""
    script = (
        "from jaxpaged.entrypoints.weight_transfer import TransferReceiver, TrainerWeightTransfer\n"
        "sender = TrainerWeightTransfer()\n"
        "receiver = TransferReceiver()\n"
        "receiver.init({'init_info': {**sender.init_info(), 'timeout_s': 1}})\n"
        "try:\n"
        "    receiver.pull({'uuid': 1, 'names': ['a'], 'dtype_names': ['float32'], 'shapes': [[2]]})\n"
        "except RuntimeError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0 and "refused: pulling update 1" in done.stdout, (done.returncode, done.stderr[-2000:])
