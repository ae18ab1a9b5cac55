"""Study: static per-channel centring of K/V (device/kv_centres.py) on a fake-quantized float32 cache.

    PYTHONPATH=$PWD python benchmarks/kv_quant_centring_study.py [--out FILE.json]

Each row runs the model on an "auto" float32 cache whose written K/V are replaced by what a
quantized page would give back: `fake_quantize(x - mu) + mu` (int8 in the Hadamard basis, fp8
unrotated, as the engine's pages), with mu the engine's own calibration (`calibrate_kv_centres`:
256 seeded random token ids, position 0 skipped). In float the `+ mu` is what the engine's model
does around the attention call (exact: tests/test_kv_centres.py); here it stays in the cache, so
every backend reads it unchanged. Rows:

  int8_fake                      int8 without centring (the engine before centring, fake-quantized)
  int8_centred                   K and V centred (what the engine's int8 cache now does)
  int8_centred_inflight_exact    ... and the step's own K/V read exact (kv_quant_inflight_study.py)
  float8_e4m3fn_centred          K and V centred
  float8_e4m3fn_centred_v        V only
  float8_e4m3fn_centred_inflight_exact

Measured by kv_quant_accuracy.py's code (greedy agreement, logit errors) against a float32 cache.
"""

import argparse
import contextlib
import sys
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quant_accuracy as accuracy  # noqa: E402  (also puts tests/ on sys.path)
from kv_quant_inflight_study import fake_quantize  # noqa: E402

from jaxpaged.device.kv_centres import calibrate_kv_centres  # noqa: E402
from jaxpaged.models import llama  # noqa: E402
from jaxpaged.models.weights import load_model  # noqa: E402

# row -> (dtype, rotated, centre K, centre V, in-flight K/V exact)
ROWS = {
    "int8_fake": ("int8", True, False, False, False),
    "int8_centred": ("int8", True, True, True, False),
    "int8_centred_inflight_exact": ("int8", True, True, True, True),
    "float8_e4m3fn_centred": ("float8_e4m3fn", False, True, True, False),
    "float8_e4m3fn_centred_v": ("float8_e4m3fn", False, False, True, False),
    "float8_e4m3fn_centred_inflight_exact": ("float8_e4m3fn", False, True, True, True),
}


@contextlib.contextmanager
def fake_quantized(centres, dtype: str, rotated: bool, centre_k: bool, centre_v: bool, inflight: bool):
    """The model on an "auto" float32 cache whose slots hold fake-quantized, centred K/V (module doc)."""
    write_kv, attention = llama.write_kv, llama.Attention
    mask = jnp.array([float(centre_k), float(centre_v)])[None, :, None, None]
    centres = jnp.asarray(centres) * mask  # [L, 2, K, H]

    def quantized(layer_idx, key, value):
        mu = centres[layer_idx]  # [2, K, H]
        return tuple(fake_quantize(x - m, dtype, rotated) + m for x, m in ((key, mu[0]), (value, mu[1])))

    def quantizing_write(kv_pages, layer_idx, key, value, slot_mapping):
        return write_kv(kv_pages, layer_idx, *quantized(layer_idx, key, value), slot_mapping)

    written = []

    def remembering_write(kv_pages, layer_idx, key, value, slot_mapping):
        written.append((layer_idx, key, value, slot_mapping))  # exact now; quantized after attention
        return write_kv(kv_pages, layer_idx, key, value, slot_mapping)

    class InflightExactAttention(attention):
        @nn.compact
        def __call__(self, *args):
            y, kv_pages = super().__call__(*args)
            layer_idx, key, value, slot_mapping = written.pop()
            return y, write_kv(kv_pages, layer_idx, *quantized(layer_idx, key, value), slot_mapping)

    if inflight:
        llama.write_kv, llama.Attention = remembering_write, InflightExactAttention
    else:
        llama.write_kv = quantizing_write
    try:
        yield "auto"
    finally:
        llama.write_kv, llama.Attention = write_kv, attention


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    model_config, params, _ = load_model(None, dtype="float32")
    centres = calibrate_kv_centres(model_config, params, "int8")  # the engine's calibration (both formats here)
    engine_rows = accuracy.cache_dtype

    @contextlib.contextmanager
    def cache_dtype(row):
        with (fake_quantized(centres, *ROWS[row]) if row in ROWS else engine_rows(row)) as engine_dtype:
            yield engine_dtype

    accuracy.cache_dtype = cache_dtype
    accuracy.ROUNDED = (*accuracy.ROUNDED, *ROWS)  # accepted by --dtypes
    return accuracy.main(["--dtypes", *ROWS, *(["--out", str(args.out)] if args.out else [])])


if __name__ == "__main__":
    main()
