"""Study: static per-channel centring of K/V (device/kv_centres.py) on a fake-quantized float32 cache.

    PYTHONPATH=$PWD python benchmarks/kv_quant_centring_study.py [--rows ROW ...] [--out FILE.json]

Each row runs the model on an "auto" float32 cache whose written K/V are replaced by what a
quantized page would give back: `fake_quantize(x - mu) + mu` (int8 in the Hadamard basis, fp8
unrotated, as the engine's pages), with mu the engine's own calibration (`calibrate_kv_centres`:
256 seeded random token ids, position 0 skipped). In float the `+ mu` is what the engine's model
does around the attention call (exact: tests/test_kv_centres.py); here it stays in the cache, so
every backend reads it unchanged (the hook: kv_quant_inflight_study.py's `fake_quantized`). Rows:

  int8_fake                      int8 without centring (the engine before centring, fake-quantized)
  int8_centred                   K and V centred (what the engine's int8 cache now does)
  int8_centred_inflight_exact    ... and the step's own K/V read exact (kv_quant_inflight_study.py)
  int8_centred_inflight_prefill  ... only a prefill chunk's own K/V exact (decode tokens read their own quantized)
  int8_centred_inflight_decode   ... only a decode token's own K/V exact (prefill chunks read theirs quantized)
  int8_centred_sink_exact        centred, position 0 never quantized (an exact attention-sink slot)
  int8_centred_smooth            centred, then per-channel smoothing (x - mu) / s, s = channel rms ** 0.5
                                 (exact in float: q * s for K, the output * s for V), then Hadamard
  int8_centred_mse               centred, per-token scale of least squared error (clip ratio 0.5-1 of amax)
  int8_centred_sink_exact_smooth sink exact and smoothing together
  float8_e4m3fn_centred          K and V centred
  float8_e4m3fn_centred_v        V only
  float8_e4m3fn_centred_inflight_exact
  float8_e4m3fn_sink_exact       fp8 as the engine's (not centred), position 0 never quantized
  float8_e4m3fn_sink_exact_inflight_exact  ... and the step's own K/V read exact

The channel rms for smoothing is that of the centred K/V on the same calibration tokens.

Measured by kv_quant_accuracy.py's code (greedy agreement, logit errors) against a float32 cache.
"""

import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_quant_inflight_study import Variant, run_rows  # noqa: E402

from jaxpaged.device.kv_centres import calibrate_kv_centres, calibration_kv  # noqa: E402
from jaxpaged.models.weights import load_model  # noqa: E402

_INT8 = dict(dtype="int8", rotated=True, centre_k=True, centre_v=True)
ROWS = {
    "int8_fake": Variant("int8", True),
    "int8_centred": Variant(**_INT8),
    "int8_centred_inflight_exact": Variant(**_INT8, inflight="all"),
    "int8_centred_inflight_prefill": Variant(**_INT8, inflight="prefill"),
    "int8_centred_inflight_decode": Variant(**_INT8, inflight="decode"),
    "int8_centred_sink_exact": Variant(**_INT8, sink_exact=True),
    "int8_centred_smooth": Variant(**_INT8, smooth=0.5),
    "int8_centred_mse": Variant(**_INT8, scale="mse"),
    "int8_centred_sink_exact_smooth": Variant(**_INT8, sink_exact=True, smooth=0.5),
    "float8_e4m3fn_centred": Variant("float8_e4m3fn", False, True, True),
    "float8_e4m3fn_centred_v": Variant("float8_e4m3fn", False, False, True),
    "float8_e4m3fn_centred_inflight_exact": Variant("float8_e4m3fn", False, True, True, inflight="all"),
    "float8_e4m3fn_sink_exact": Variant("float8_e4m3fn", False, sink_exact=True),
    "float8_e4m3fn_sink_exact_inflight_exact": Variant("float8_e4m3fn", False, sink_exact=True, inflight="all"),
}


def calibration() -> dict:
    """The engine's centres (both formats here) and the centred K/V's channel rms."""
    model_config, params, _ = load_model(None, dtype="float32")
    centres = calibrate_kv_centres(model_config, params, "int8")
    kv = calibration_kv(model_config, params)
    rms = jnp.sqrt(jnp.mean((kv - centres[:, :, :, None]) ** 2, axis=3))
    return dict(centres=centres, rms=rms)


if __name__ == "__main__":
    run_rows(ROWS, calibration=calibration)
