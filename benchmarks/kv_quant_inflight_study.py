"""Study: what if attention read the step's own K/V in full precision (only earlier context quantized)?

    PYTHONPATH=$PWD python benchmarks/kv_quant_inflight_study.py [--out FILE.json]

Today every backend attends to the pages the step has just written, so a prefill chunk's tokens see
each other's K/V quantized (as vLLM V1's FlashAttention backend does: `reshape_and_cache_flash`, then
`flash_attn_varlen_func` on the fp8 cache). The prompt's hidden states then carry the quantization
error into every later layer's K/V: the error compounds over the layers before a token is stored.
With the in-flight K/V exact (vLLM V0 did this for a prompt with no cached prefix), each stored
token is quantized once, from the float32 model's own K/V.

No backend can do that today, so this measures it on a *fake-quantized float32 cache*: the model
writes the exact K/V, attends, and then overwrites those slots with quantize -> dequantize of the
same K/V (int8: in the Hadamard basis, as the engine's int8 pages; fp8: unrotated). Rows with the
same names as `kv_quant_accuracy.py`'s, measured by its code (greedy agreement, logit errors).
Fake-quantized fp8 without the in-flight change reproduces the engine's fp8 row token for token.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import flax.linen as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_quant_accuracy as accuracy  # noqa: E402  (also puts tests/ on sys.path)

from jaxpaged.models import llama  # noqa: E402
from jaxpaged.ops import kv_quant  # noqa: E402

ROWS = {"int8_inflight_exact": ("int8", True), "float8_e4m3fn_inflight_exact": ("float8_e4m3fn", False)}


def fake_quantize(x, dtype: str, rotated: bool):
    """x as a quantized page would give it back (in x's basis)."""
    if rotated:
        x = kv_quant.rotate(x)
    x = kv_quant.dequantize(*kv_quant.quantize(x, dtype), x.dtype)
    return kv_quant.rotate(x) if rotated else x


@contextlib.contextmanager
def inflight_exact(dtype: str, rotated: bool):
    """The model on an "auto" float32 cache, slots fake-quantized after the layer's attention."""
    write_kv, attention = llama.write_kv, llama.Attention
    written = []

    def remembering_write(kv_pages, layer_idx, key, value, slot_mapping):
        written.append((layer_idx, key, value, slot_mapping))  # exact now; quantized after attention
        return write_kv(kv_pages, layer_idx, key, value, slot_mapping)

    class InflightExactAttention(attention):
        @nn.compact
        def __call__(self, *args):
            y, kv_pages = super().__call__(*args)
            layer_idx, key, value, slot_mapping = written.pop()
            quantized = (fake_quantize(key, dtype, rotated), fake_quantize(value, dtype, rotated))
            return y, write_kv(kv_pages, layer_idx, *quantized, slot_mapping)

    llama.write_kv, llama.Attention = remembering_write, InflightExactAttention
    try:
        yield "auto"
    finally:
        llama.write_kv, llama.Attention = write_kv, attention


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    engine_rows = accuracy.cache_dtype

    @contextlib.contextmanager
    def cache_dtype(row):
        with (inflight_exact(*ROWS[row]) if row in ROWS else engine_rows(row)) as engine_dtype:
            yield engine_dtype

    accuracy.cache_dtype = cache_dtype
    accuracy.ROUNDED = (*accuracy.ROUNDED, *ROWS)  # accepted by --dtypes
    return accuracy.main(["--dtypes", *ROWS, *(["--out", str(args.out)] if args.out else [])])


if __name__ == "__main__":
    main()
