"""Study: what if attention read the step's own K/V in full precision (only earlier context quantized)?

    PYTHONPATH=$PWD python benchmarks/kv_quant_inflight_study.py [--rows ROW ...] [--out FILE.json]

Today every backend attends to the pages the step has just written, so a prefill chunk's tokens see
each other's K/V quantized (as vLLM V1's FlashAttention backend does: `reshape_and_cache_flash`, then
`flash_attn_varlen_func` on the fp8 cache). The prompt's hidden states then carry the quantization
error into every later layer's K/V: the error compounds over the layers before a token is stored.
With the in-flight K/V exact (vLLM V0 did this for a prompt with no cached prefix), each stored
token is quantized once, from the float32 model's own K/V.

No backend can do that today, so this measures it on a *fake-quantized float32 cache*
(`fake_quantized`, also the hook of kv_quant_centring_study.py): the model writes what a quantized
page would give back (int8: in the Hadamard basis, as the engine's int8 pages; fp8: unrotated), or,
for the tokens whose in-flight K/V stay exact, writes them exact, attends, and then overwrites those
slots with their quantized values. Rows with the same names as `kv_quant_accuracy.py`'s, measured
by its code (greedy agreement, logit errors). Fake-quantized fp8 without the in-flight change
reproduces the engine's fp8 row token for token.
"""

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quant_accuracy as accuracy  # noqa: E402  (also puts tests/ on sys.path)

from jaxpaged.models import llama  # noqa: E402
from jaxpaged.ops import kv_quant  # noqa: E402

_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5)  # "mse" scales: amax times one of these


@dataclass(frozen=True)
class Variant:
    """One fake-quantized cache: what a page holds and which of the step's own K/V attention reads exact."""

    dtype: str  # "int8" | "float8_e4m3fn"
    rotated: bool  # quantized in the Hadamard basis (the engine's int8)
    centre_k: bool = False  # stores k - mu_k (device/kv_centres.py); needs `centres`
    centre_v: bool = False
    inflight: str = "none"  # the step's own K/V read exact: "none" | "all" | "prefill" (sequences with
    #                         more than one new token) | "decode" (a sequence's one new token)
    sink_exact: bool = False  # position 0 is never quantized (an exact side slot for the attention sink)
    smooth: float = 0.0  # SmoothQuant exponent: stores (x - mu) / s with s = channel rms ** smooth; needs `rms`
    scale: str = "amax"  # per-token scale: "amax" | "mse" (the clip ratio of least squared error)


ROWS = {"int8_inflight_exact": Variant("int8", True, inflight="all"),
        "float8_e4m3fn_inflight_exact": Variant("float8_e4m3fn", False, inflight="all")}


def fake_quantize(x, dtype: str, rotated: bool, scale: str = "amax"):
    """x as a quantized page would give it back (in x's basis)."""
    if rotated:
        x = kv_quant.rotate(x)
    if scale == "mse":  # int8: the amax clip ratio with the least squared error, per vector
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        tries = [jnp.clip(jnp.round(x / s), -127, 127) * s
                 for s in (jnp.where(amax == 0, 1.0, amax * r / 127) for r in _CLIP_RATIOS)]
        errors = jnp.stack([jnp.sum((t - x) ** 2, axis=-1) for t in tries])
        x = jnp.take_along_axis(jnp.stack(tries), jnp.argmin(errors, axis=0)[None, ..., None], axis=0)[0]
    else:
        x = kv_quant.dequantize(*kv_quant.quantize(x, dtype), x.dtype)
    return kv_quant.rotate(x) if rotated else x


def _token_masks(variant: Variant, sin, query_start_loc):
    """(exact while attending, exact for good) masks over the step's tokens."""
    num_tokens = sin.shape[0]
    counts = jnp.diff(query_start_loc)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, jnp.arange(num_tokens), side="right") - 1, 0, counts.shape[0] - 1)
    new_tokens = counts[seq]
    inflight = {"none": jnp.zeros(num_tokens, bool), "all": jnp.ones(num_tokens, bool),
                "prefill": new_tokens > 1, "decode": new_tokens == 1}[variant.inflight]
    sink = jnp.all(sin == 0, axis=-1) if variant.sink_exact else jnp.zeros(num_tokens, bool)  # position 0
    return inflight | sink, sink


@contextlib.contextmanager
def fake_quantized(variant: Variant, centres=None, rms=None):
    """The model on an "auto" float32 cache whose slots hold fake-quantized K/V (module doc).

    `centres` / `rms`: [num_layers, 2, num_kv_heads, head_dim] from the engine's calibration."""
    write_kv, attention = llama.write_kv, llama.Attention
    mask = jnp.array([float(variant.centre_k), float(variant.centre_v)])[None, :, None, None]
    centres = None if centres is None else jnp.asarray(centres) * mask
    if variant.smooth:
        rms = jnp.asarray(rms) ** variant.smooth
        smoothing = rms / jnp.exp(jnp.log(rms).mean(-1, keepdims=True))  # geometric mean 1 per head
    steps = []  # per attention call: [exact-while-attending mask, exact-for-good mask, written K/V]

    def quantized(layer_idx, exact, key, value):
        out = []
        for i, x in enumerate((key, value)):
            mu = 0.0 if centres is None else centres[layer_idx, i]
            s = smoothing[layer_idx, i] if variant.smooth else 1.0
            q = fake_quantize((x - mu) / s, variant.dtype, variant.rotated, variant.scale) * s + mu
            out.append(jnp.where(exact[:, None, None], x, q))
        return out

    def quantizing_write(kv_pages, layer_idx, key, value, slot_mapping):
        step = steps[-1]
        step.append((layer_idx, key, value, slot_mapping))
        return write_kv(kv_pages, layer_idx, *quantized(layer_idx, step[0], key, value), slot_mapping)

    class FakeQuantizedAttention(attention):
        @nn.compact
        def __call__(self, x, cos, sin, kv_pages, layer_idx, slot_mapping, block_tables, seq_lens,
                     query_start_loc, *rest):
            steps.append(list(_token_masks(variant, sin, query_start_loc)))
            y, kv_pages = super().__call__(x, cos, sin, kv_pages, layer_idx, slot_mapping, block_tables, seq_lens,
                                           query_start_loc, *rest)
            _, for_good, (layer_idx, key, value, slot_mapping) = steps.pop()
            if variant.inflight != "none":  # the slots read exact while attending: quantized now
                kv_pages = write_kv(kv_pages, layer_idx, *quantized(layer_idx, for_good, key, value), slot_mapping)
            return y, kv_pages

    llama.write_kv, llama.Attention = quantizing_write, FakeQuantizedAttention
    try:
        yield "auto"
    finally:
        llama.write_kv, llama.Attention = write_kv, attention


def run_rows(rows: dict, argv=None, calibration=dict) -> dict:
    """kv_quant_accuracy.py's measurement of `rows` (name -> Variant) besides its own; `calibration()`
    gives `fake_quantized`'s keyword arguments."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", nargs="+", default=list(rows), choices=list(rows))
    args = parser.parse_args(argv)
    kwargs = calibration()
    engine_rows = accuracy.cache_dtype

    @contextlib.contextmanager
    def cache_dtype(row):
        with (fake_quantized(rows[row], **kwargs) if row in rows else engine_rows(row)) as engine_dtype:
            yield engine_dtype

    accuracy.cache_dtype = cache_dtype
    accuracy.ROUNDED = (*accuracy.ROUNDED, *rows)  # accepted by --dtypes
    return accuracy.main(["--dtypes", *args.rows, *(["--out", str(args.out)] if args.out else [])])


if __name__ == "__main__":
    run_rows(ROWS)
