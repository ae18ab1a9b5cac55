"""The converted-parameter cache: exact round trips, keys, and damaged entries treated as misses."""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models import checkpoint


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(checkpoint.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def sample_params():
    """Nested like `params_from_hf`'s output, with the dtypes a cache must keep apart."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            "embedding": rng.standard_normal((11, 8)).astype(np.float32),
            "layers": {
                "q_proj": jnp.asarray(rng.standard_normal((2, 8, 3, 4)), jnp.bfloat16),
                "input_norm": {"scale": rng.standard_normal((2, 8)).astype(np.float32)},
            },
            "final_norm": {"scale": np.arange(8, dtype=np.int32)},
        }
    }


def assert_same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def test_round_trip_is_exact(cache_dir):
    params = sample_params()
    entry = checkpoint.save_params(params, "k")
    assert entry == str(cache_dir / "params" / "k")
    assert_same(checkpoint.restore_params("k"), params)
    assert_same(checkpoint.restore_params("k", like=params), params)


def test_restore_lands_in_host_memory_never_on_the_default_device(monkeypatch):
    """Issue 30 item 11: orbax restores onto the default device unless told otherwise, so a cached
    model would land whole on one accelerator before the engine splits it. Every leaf is asked for
    on the host's CPU device, with and without `like`."""
    import orbax.checkpoint as ocp

    asked = []
    restore = ocp.StandardCheckpointer.restore

    def spy(self, directory, target=None, *args, **kwargs):
        asked.append(target)
        return restore(self, directory, target, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointer, "restore", spy)
    params = sample_params()
    checkpoint.save_params(params, "k")
    for like in (None, params):
        assert_same(checkpoint.restore_params("k", like=like), params)
    host = jax.devices("cpu")[0]
    assert len(asked) == 2
    for target in asked:
        leaves = jax.tree_util.tree_leaves(target)
        assert len(leaves) == 4 and all(leaf.sharding.device_set == {host} for leaf in leaves)


def test_miss_when_absent():
    assert checkpoint.restore_params("never-saved") is None


def test_key_follows_file_identity_dtype_and_format(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"abc")
    key = checkpoint.params_cache_key([str(weights)], np.float32)
    assert key == checkpoint.params_cache_key([str(weights)], "float32")  # stable
    assert key != checkpoint.params_cache_key([str(weights)], jnp.bfloat16)
    assert key != checkpoint.params_cache_key([str(weights)], np.float32, format_tag="v2")
    os.utime(weights, ns=(0, 123))  # same content, new mtime: a rewritten file
    assert key != checkpoint.params_cache_key([str(weights)], np.float32)
    with pytest.raises(ValueError, match="at least one source file"):
        checkpoint.params_cache_key([], np.float32)


def _damage_data_files(entry):
    """Overwrite every array data file of the orbax checkpoint with garbage of the same size."""
    damaged = 0
    for root, _, files in os.walk(os.path.join(entry, "state")):
        if os.path.basename(root) == "d":  # ocdbt's data directories
            for name in files:
                path = os.path.join(root, name)
                size = os.path.getsize(path)
                with open(path, "wb") as f:
                    f.write(b"\x5a" * size)
                damaged += 1
    assert damaged, "no data files found: the checkpoint layout changed, update this test"


# Reading garbage, orbax's async reader sometimes posts a callback to an event loop it already
# closed; the error is raised and handled, the late callback only prints. Not ours to fix.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["no_complete_marker", "garbage_data", "deleted_state", "wrong_record"])
def test_damaged_entry_is_a_miss_then_rebuilt(damage):
    params = sample_params()
    entry = checkpoint.save_params(params, "k")
    if damage == "no_complete_marker":  # a save cut short before it was marked complete
        os.remove(os.path.join(entry, "COMPLETE"))
    elif damage == "garbage_data":
        _damage_data_files(entry)
    elif damage == "deleted_state":
        import shutil

        shutil.rmtree(os.path.join(entry, "state"))
    elif damage == "wrong_record":  # the entry holds other shapes than it claims
        with open(os.path.join(entry, "COMPLETE"), "w") as f:
            f.write('{"key": "k", "leaves": [["x", [1], "float32"]]}')
    assert checkpoint.restore_params("k") is None
    assert not os.path.exists(entry)  # deleted, so the rebuild starts clean
    checkpoint.save_params(params, "k")
    assert_same(checkpoint.restore_params("k"), params)


def test_cached_params_converts_once(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights")
    calls = []

    def convert():
        calls.append(1)
        return sample_params()

    first, hit = checkpoint.cached_params([str(weights)], np.float32, convert)
    assert not hit and len(calls) == 1
    second, hit = checkpoint.cached_params([str(weights)], np.float32, convert, like=first)
    assert hit and len(calls) == 1  # the second start skips conversion
    assert_same(second, first)
    _, hit = checkpoint.cached_params([str(weights)], jnp.bfloat16, convert)
    assert not hit and len(calls) == 2  # another dtype is another entry


@pytest.mark.slow
def test_real_model_round_trip_and_timings(capsys):
    """Convert the bundled GGUF (parse + dequantize + params_from_hf), save, restore: exact.

    On a quiet 2-core machine: convert 2.7 s, restore 1.1 s. Under heavy load (load average 9)
    they came as close as 5.2 vs 3.6 s, so the assertion is only that restoring wins, with no
    margin; the times are printed for the record.
    """
    from jaxpaged.models import ModelConfig, params_from_hf
    from jaxpaged.models.gguf import load_gguf
    from jaxpaged.models.loading import default_model_path

    path = default_model_path()
    start = time.perf_counter()
    hf_config, state_dict, _ = load_gguf(path)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    params = params_from_hf(config, state_dict)
    convert_s = time.perf_counter() - start
    del state_dict

    key = checkpoint.params_cache_key([path], config.dtype)
    start = time.perf_counter()
    checkpoint.save_params(params, key)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    restored = checkpoint.restore_params(key, like=params)
    restore_s = time.perf_counter() - start

    assert_same(restored, params)
    with capsys.disabled():
        print(f"\nSmolLM2-135M float32 params: convert {convert_s:.1f} s, save {save_s:.1f} s, restore {restore_s:.1f} s")
    assert restore_s < convert_s, f"restoring ({restore_s:.1f} s) should beat converting ({convert_s:.1f} s)"
