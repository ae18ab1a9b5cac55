"""Every decode bucket the engine compiles, measured on the device beside its static floor.

For each model (Qwen3-0.6B shapes, then Llama-3-8B shapes; random bf16 weights) the engine's own
configuration is resolved for this machine (EngineConfig defaults: max_num_seqs, max_model_len,
page size, attention backend) and one `ModelRunner` is built, as the engine builds it. Each decode
bucket it compiles (`runner.decode_buckets`) is run full, every sequence at context 256, 1024 and
4096; Llama-3-8B runs batch 1 and 64 in the buckets the engine picks for them (on a GPU the smallest
decode bucket is 2: batch 1 is one sequence and one padding row):

    measured_ms    median of `--repeats` calls of `runner.execute` (host packing, transfer, the
                   jitted donated step) each waited for with block_until_ready, after warm-up
    pipelined_ms   the same calls issued back to back, one wait at the end, divided by their number
                   (what an engine that overlaps host and device sees)
    floor_ms       the HBM bytes of that very compiled program (`compiled.as_text()` accounted by
                   jaxpaged.static_profile.hlo_accounting, the KV buffer counted as the live
                   context it reads) at 4.8 TB/s, the H200's HBM bandwidth
    ratio          measured_ms / floor_ms

The buckets' programs are compiled concurrently (threads: XLA compiles outside the GIL), each row
records how many were. The block table's width is ceil(max_model_len / page_size) whatever the context, so a bucket is one
program for every context: each row records the runner's compile count, which must not move.
Pages: each sequence gets its own pages while the pool holds them; past that, page ids wrap around
the pool, which is then far larger than the L2 cache (the stride is recorded), so a re-read page
comes from HBM all the same.

`--dry-run` (any machine): tiny models, contexts and repeats; measured figures are null and the
floor is the program compiled here (a CPU program), labelled so. The JSON is rewritten after every
row, so a run cut short keeps what it measured.

    python -m benchmarks.bench_decode_steps --out /tmp/decode_steps.json [--dry-run]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment
from benchmarks.workloads import QWEN3_0_6B_SHAPES
from jaxpaged.baseline.measure import CompileCounter
from jaxpaged.config import EngineConfig
from jaxpaged.device.backends import attention_fn
from jaxpaged.device.runner import ModelRunner
from jaxpaged.device.step_input import pack_step_input
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.static_profile.hlo_accounting import BufferOverride, account, entry_param_number
from jaxpaged.static_profile.floors import PER_LAUNCH_S
from jaxpaged.static_profile.target import H200

H200_HBM_BYTES_PER_S = H200.hbm_bandwidth  # the H200's HBM3e bandwidth (datasheet, the static profile's target)
LLAMA3_8B_SHAPES = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, rope_theta=500_000.0, max_position_embeddings=8192,
                        dtype="bfloat16")
TINY_SHAPES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, max_position_embeddings=256, dtype="float32")


@dataclasses.dataclass(frozen=True)
class ModelCase:
    name: str
    shapes: dict
    batches: tuple[int, ...] | None  # None: every decode bucket; else the buckets that hold these batches
    contexts: tuple[int, ...]
    engine_overrides: dict = dataclasses.field(default_factory=dict)  # dry run: a tiny engine


GPU_CASES = (
    ModelCase("qwen3-0.6b", QWEN3_0_6B_SHAPES, None, (256, 1024, 4096)),
    ModelCase("llama3-8b", LLAMA3_8B_SHAPES, (1, 64), (256, 1024, 4096)),
)
DRY_CASES = (
    ModelCase("tiny-qwen3-like", dict(TINY_SHAPES, qk_norm=True, tie_word_embeddings=True), None, (16, 32, 64),
              dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16)),
    ModelCase("tiny-llama-like", TINY_SHAPES, (1, 3), (16, 64), dict(max_num_seqs=4, max_model_len=64,
                                                                      max_num_batched_tokens=16)),
)


def decode_step_input(runner: ModelRunner, bucket: int, num_seqs: int, context: int, rng: np.random.Generator):
    """Decode bucket `bucket` with `num_seqs` live sequences of `context` tokens each (after this step),
    the remaining rows padding, as prepare_step_input pads them.

    Sequence s owns logical pages 0..n-1 (n = ceil(context / page_size)) at physical pages
    1 + (s * n + j) mod (num_pages - 1): distinct while the pool holds them all."""
    page_size, pages_per_seq = runner.page_size, runner.pages_per_seq
    n = math.ceil(context / page_size)
    page_ids = 1 + (np.arange(num_seqs)[:, None] * n + np.arange(n)[None, :]) % (runner.num_pages - 1)
    block_tables = np.zeros((bucket, pages_per_seq), np.int32)
    block_tables[:num_seqs, :n] = page_ids
    position = context - 1  # the new token's position; its K/V lands in the last page
    live = np.arange(bucket) < num_seqs
    slots = np.full(bucket, runner.num_pages * page_size, np.int32)  # padding rows write nothing
    slots[:num_seqs] = page_ids[:, position // page_size] * page_size + position % page_size
    token_ids = np.where(live, rng.integers(0, runner.config.vocab_size, bucket), 0).astype(np.int32)
    return dataclasses.replace(
        runner.dummy_step_input(bucket, decode_only=True), token_ids=token_ids,
        positions=np.where(live, position, 0).astype(np.int32), slot_mapping=slots, block_tables=block_tables,
        seq_lens=np.where(live, context, 0).astype(np.int32),
        query_start_loc=np.minimum(np.arange(bucket + 1), num_seqs).astype(np.int32),  # padding repeats the total
        logits_indices=np.where(live, np.arange(bucket), 0).astype(np.int32))


def live_kv_bytes_per_layer(config: ModelConfig, num_seqs: int, context: int) -> int:
    """K and V of every live token of one layer: what the attention must read."""
    return num_seqs * context * config.num_kv_heads * config.head_dim * 2 * jnp.dtype(config.dtype).itemsize


def floor_of(compiled_text: str, config: ModelConfig, num_seqs: int, context: int, bandwidth: float) -> dict:
    kv_param = entry_param_number(compiled_text, "kv_pages")
    acc = account(compiled_text, BufferOverride(kv_param, bytes_read=live_kv_bytes_per_layer(config, num_seqs, context)))
    return dict(hbm_bytes=acc.hbm_bytes, launches=acc.num_launches, copies=acc.num_copies,
                floor_ms=acc.hbm_bytes / bandwidth * 1e3,
                # + launches x the static profile's uncalibrated per-launch cost; a measured row calibrates
                # it: (measured_ms - floor_ms) / launches
                launch_floor_ms=acc.hbm_bytes / bandwidth * 1e3 + acc.num_launches * PER_LAUNCH_S * 1e3,
                accounting_warnings=acc.warnings[:3])


def time_steps(runner: ModelRunner, step_input, repeats: int) -> tuple[float, float]:
    """(median ms of waited calls, ms per call issued back to back) after 3 warm-up calls."""
    for _ in range(3):
        jax.block_until_ready(runner.execute(step_input))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(runner.execute(step_input))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(repeats):
        logits = runner.execute(step_input)
    jax.block_until_ready((logits, runner.kv_pages))
    return statistics.median(times) * 1e3, (time.perf_counter() - start) / repeats * 1e3


def pool_pages(config: ModelConfig, page_size: int, wanted: int, dry_run: bool) -> int:
    """`wanted` pages, or as many as 40% of the device's free memory holds (page 0 included)."""
    if dry_run:
        return wanted
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    page_bytes = config.num_layers * 2 * config.num_kv_heads * page_size * config.head_dim * jnp.dtype(config.dtype).itemsize
    return max(2, min(wanted, int(0.4 * free) // page_bytes))


def run_case(case: ModelCase, args, report: dict, save) -> None:
    on_gpu = jax.default_backend() == "gpu"
    config = ModelConfig(**case.shapes)
    engine = EngineConfig(dtype=config.dtype, **case.engine_overrides).resolved(
        on_gpu=on_gpu, model_max_len=config.max_position_embeddings)
    params = init_params(config, jax.random.key(0))
    # The runner's decode buckets are the engine's: they depend on max_num_seqs and the platform only.
    probe = ModelRunner(config, params, num_pages=2, page_size=engine.page_size, max_num_seqs=engine.max_num_seqs,
                        max_num_batched_tokens=engine.max_num_batched_tokens, max_model_len=engine.max_model_len,
                        attention_fn=attention_fn(engine.attention_backend))
    # (bucket, live sequences): every bucket full, or the bucket the engine picks for each batch.
    shapes = [(b, b) for b in probe.decode_buckets] if case.batches is None else [
        (min(b for b in probe.decode_buckets if b >= n), n) for n in case.batches]
    buckets = tuple(b for b, _ in shapes)
    num_seqs = dict(shapes)
    del probe
    contexts = [c for c in case.contexts if c <= engine.max_model_len]
    wanted = 1 + max(num_seqs.values()) * math.ceil(max(contexts) / engine.page_size)
    num_pages = pool_pages(config, engine.page_size, wanted, args.dry_run)
    runner = ModelRunner(config, params, num_pages=num_pages, page_size=engine.page_size,
                         max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                         max_model_len=engine.max_model_len, attention_fn=attention_fn(engine.attention_backend))
    del params  # the runner holds its own copy
    report["models"][case.name] = dict(
        shapes=case.shapes, max_num_seqs=engine.max_num_seqs, max_model_len=engine.max_model_len,
        page_size=engine.page_size, attention_backend=engine.attention_backend, decode_buckets=list(runner.decode_buckets),
        measured_buckets=list(buckets), num_pages=num_pages, pages_wanted=wanted,
        pages_per_seq=runner.pages_per_seq, per_layer_weights=runner.per_layer_weights)
    save()
    rng = np.random.default_rng(0)
    inputs = {b: {c: decode_step_input(runner, b, num_seqs[b], c, rng) for c in contexts} for b in buckets}
    for b in buckets:  # one program per bucket: the context changes the data, never a shape
        layouts = {pack_step_input(s)[1] for s in inputs[b].values()}
        assert len(layouts) == 1, f"bucket {b}: contexts give different step shapes {layouts}"

    # Lower every bucket here, compile them all at once (XLA compiles outside the GIL); each compile
    # also fills the persistent cache that runner.execute's own compile then reads.
    lowered = {}
    for b in buckets:
        start = time.perf_counter()
        lowered[b] = (runner.trace_step(inputs[b][contexts[0]]).lower(), time.perf_counter() - start)
    bandwidth = H200_HBM_BYTES_PER_S
    label = ("estimated from the program compiled here for this GPU, HBM bytes at 4.8 TB/s (H200)" if on_gpu else
             f"estimated from the program compiled here for {jax.default_backend()} (dry run), bytes at 4.8 TB/s")
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(buckets))) as pool:
        def compile_one(b):
            start = time.perf_counter()
            return lowered[b][0].compile(), time.perf_counter() - start
        futures = {b: pool.submit(compile_one, b) for b in buckets}
        compiled = {}
        for b in buckets:  # floors as soon as each program exists: a cut run keeps them
            compiled[b], compile_s = futures[b].result()
            text = compiled[b].as_text()
            for c in contexts:
                report["rows"].append(dict(
                    model=case.name, bucket=b, context=c, num_seqs=num_seqs[b], measured_ms=None,
                    pipelined_ms=None, **floor_of(text, runner.config, num_seqs[b], c, bandwidth), ratio=None,
                    floor_label=label, compiled_concurrently=len(buckets),
                    lower_s=round(lowered[b][1], 2), compile_s=round(compile_s, 2)))
            save()
    del lowered, compiled

    kv_page_bytes = runner.kv_cache_bytes() // runner.num_pages
    for b in buckets:
        first = True
        for c in contexts:
            row = next(r for r in report["rows"] if (r["model"], r["bucket"], r["context"]) == (case.name, b, c))
            n = math.ceil(c / runner.page_size)
            row["page_stride_bytes"] = None if num_seqs[b] * n < num_pages else (num_pages - 1) * kv_page_bytes
            with CompileCounter() as compiles:
                if args.dry_run:  # CPU times mean nothing: run the steps once, report nothing
                    jax.block_until_ready(runner.execute(inputs[b][c]))
                else:
                    row["measured_ms"], row["pipelined_ms"] = time_steps(runner, inputs[b][c], args.repeats)
                    row["ratio"] = row["measured_ms"] / row["floor_ms"]
            # The bucket's first context may lower the program once more (jit's own call path; XLA's
            # compile then comes from the persistent cache); every later context must add nothing.
            row["lowerings"] = compiles.count
            save()
            if not first and compiles.count:
                raise AssertionError(f"{case.name} bucket {b} context {c}: {compiles.count} new compilations; "
                                     "the context should change the step's data only")
            first = False
    del runner, inputs
    jax.clear_caches()


def print_rows(rows: list[dict]) -> None:
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    print(f"{'model':<16} {'bucket':>6} {'seqs':>4} {'context':>7} {'measured ms':>11} {'pipelined':>9} {'floor ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:<16} {r['bucket']:>6} {r['num_seqs']:>4} {r['context']:>7} {fmt(r['measured_ms'], '11.3f')} "
              f"{fmt(r['pipelined_ms'], '9.3f')} {r['floor_ms']:9.4f} {fmt(r['ratio'], '6.2f')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file, rewritten after every row")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on any device; no timings")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per row (median reported); >= 20 on a GPU")
    parser.add_argument("--models", default=None, help="comma-separated subset of the case names")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.dry_run:
        print("bench_decode_steps needs a GPU; pass --dry-run to check it elsewhere", file=sys.stderr)
        return 2
    cases = DRY_CASES if args.dry_run else GPU_CASES
    if args.models:
        cases = [c for c in cases if c.name in args.models.split(",")]
    report = dict(benchmark="bench_decode_steps", environment=environment(), dry_run=args.dry_run,
                  hbm_bytes_per_s=H200_HBM_BYTES_PER_S, repeats=args.repeats, models={}, rows=[], status="running")

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.out)

    for case in cases:
        run_case(case, args, report, save)
    report["status"] = "done"
    save()
    print_rows(report["rows"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
