"""The dense-cache baseline: the design PagedAttention replaced, built as fast as that design can be.

Every sequence of a static batch owns one contiguous KV region reserved at `max_model_len`, a new
batch starts only when every sequence of the previous one has finished, and attention is dense over
the region. Everything else is jaxpaged's own: the same Flax `CausalLM` (its attention is pluggable,
so the "pages" of a row are simply consecutive), the same jit discipline (one donated KV buffer,
shapes from a fixed set of buckets, all compiled in `warmup`), the same sampler.

KV layout: the buffer is jaxpaged's `[num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]`
with `num_pages = batch_size * pages_per_row`, and row b owns pages `b * pages_per_row ...
(b + 1) * pages_per_row - 1`. Reshaped per layer it is the classic dense cache:

    k_pages [K, num_pages, page_size, H]  --reshape (free)-->  k [K, batch_size, max_len, H]
    slot of (row b, position p) = b * max_len + p            (max_len = pages_per_row * page_size)

A static batch runs in two phases:

    prefill  groups of R rows, each padded on the right to S = bucket(longest prompt):
             R*S tokens, token j of row r at position j; padding tokens write nothing
    decode   all batch_size rows, one token each, attending to the first kv_len = bucket(longest
             context) positions of every row; finished rows keep their region and keep being
             computed (their writes are dropped) until the whole batch is done

That idle compute, the region reserved for tokens that never come, and the wait for the slowest
sequence are the costs of the design; the benchmark measures them against jaxpaged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import CausalLM
from jaxpaged.planner.request import SamplingParams, banned_token_ids, seed_for
from jaxpaged.sample.sampler import RowSpec, make_sampling_arrays, sample

# Legend: R=rows (sequences of the batch, or a prefill group)  S=query tokens per row
#         K=num_kv_heads  G=query heads per KV head  H=head_dim  L=kv_len (key positions read)


def dense_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    k_pages: Float[Array, "num_kv_heads num_pages page_size head_dim"],
    v_pages: Float[Array, "num_kv_heads num_pages page_size head_dim"],
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    scale: float,
    soft_cap: float | None = None,
    pages_per_row: int,
    kv_len: int,
    gather_rows: bool,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """Masked dense attention over contiguous per-row caches (jaxpaged's attention signature).

    The batch is a rectangle: `num_seqs` rows of `S = num_tokens // num_seqs` query tokens each
    (`query_start_loc` is ignored: it is always `arange(num_seqs + 1) * S`). Row r's query j sits at
    position `seq_lens[r] - S + j` and sees keys `0..position` of its row; rows with `seq_lens` 0
    are padding and give zeros. Only the first `kv_len` positions of a row are read.

    Which rows: with `gather_rows`, row r is the cache row `block_tables[r, 0] // pages_per_row`
    (the row's first page); without it, the rows are the whole cache in order (decode).
    """
    del query_start_loc
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_rows = seq_lens.shape[0]
    if num_tokens % num_rows:
        raise ValueError(f"{num_tokens=} must be a multiple of {num_rows=}: the dense batch is a rectangle")
    if num_pages % pages_per_row:
        raise ValueError(f"{num_pages=} must be a multiple of {pages_per_row=}")
    q_len, group = num_tokens // num_rows, num_heads // num_kv_heads
    max_len = pages_per_row * page_size
    if kv_len > max_len:
        raise ValueError(f"{kv_len=} exceeds the row length {max_len}")

    # [K, num_pages, page_size, H] -> [K, batch_size, max_len, H]: a free reshape, rows are contiguous.
    k = k_pages.reshape(num_kv_heads, num_pages // pages_per_row, max_len, head_dim)[:, :, :kv_len]
    v = v_pages.reshape(num_kv_heads, num_pages // pages_per_row, max_len, head_dim)[:, :, :kv_len]
    if gather_rows:
        row_ids = block_tables[:, 0] // pages_per_row  # [R]
        k, v = k[:, row_ids], v[:, row_ids]  # [K, R, L, H]
    elif k.shape[1] != num_rows:
        raise ValueError(f"without gather_rows the batch must cover all {k.shape[1]} rows, got {num_rows}")

    q = q.reshape(num_rows, q_len, num_kv_heads, group, head_dim)  # [R, S, K, G, H]
    scores = jnp.einsum("rskgh,krlh->rkgsl", q, k, preferred_element_type=jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    position = seq_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]  # [R, S]
    visible = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :] <= position[:, :, None]  # [R, S, L]
    visible &= (seq_lens > 0)[:, None, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # Padding rows see no key: softmax of all -inf would be NaN, so they get zeros.
    has_key = jnp.any(visible, axis=-1)[:, None, None, :, None]  # [R, 1, 1, S, 1]
    probs = jax.nn.softmax(jnp.where(has_key, scores, 0.0), axis=-1)
    probs = jnp.where(has_key, probs, 0.0)
    out = jnp.einsum("rkgsl,krlh->rskgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def pow2_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest` below `largest`, then `largest` itself."""
    buckets, b = [], smallest
    while b < largest:
        buckets.append(b)
        b *= 2
    return (*buckets, largest)


def batch_size_for_budget(kv_budget_tokens: int, max_model_len: int) -> int:
    """How many sequences a dense cache reserving `max_model_len` slots each fits in the budget."""
    batch_size = kv_budget_tokens // max_model_len
    if batch_size < 1:
        raise ValueError(
            f"a KV budget of {kv_budget_tokens} tokens holds no sequence of max_model_len={max_model_len}; "
            "raise the budget or lower max_model_len"
        )
    return batch_size


@dataclasses.dataclass
class DenseOutput:
    """One request's result, with the times (perf_counter seconds) the benchmark needs."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclasses.dataclass
class DenseStep:
    """What one device step of the baseline did (the benchmark's per-step record)."""

    kind: str  # "prefill" | "decode"
    num_tokens: int  # real tokens computed (prompt tokens, or one per unfinished row)
    num_padded_tokens: int  # tokens the device computed, padding included
    num_running: int  # unfinished sequences of the batch
    num_live_tokens: int  # tokens held in the cache by unfinished sequences
    num_reserved_tokens: int  # slots reserved by the current batch (batch_size * max_len)
    num_output_tokens: int  # tokens sampled this step that count (unfinished sequences)


class DenseBaseline:
    """Static batching over a contiguous KV cache; same model, jit discipline and sampler as jaxpaged.

    Args:
      model_config, params: the model (params as `CausalLM` takes them, numpy or device arrays).
      max_model_len: prompt + output tokens of one sequence; each row reserves this many slots.
      batch_size: rows of the static batch (use `batch_size_for_budget` for a KV budget).
      page_size: granularity of `max_model_len` (rounded up to it) and of the bucket sizes.
      max_prefill_tokens: tokens of one prefill call (a group of rows); bounds prefill memory.
      eos_token_id: stops a request that does not set `ignore_eos`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        params,
        *,
        max_model_len: int,
        batch_size: int,
        page_size: int = 16,
        max_prefill_tokens: int = 2048,
        eos_token_id: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")
        self.config = model_config
        self.batch_size, self.page_size = batch_size, page_size
        self.pages_per_row = math.ceil(max_model_len / page_size)
        self.max_model_len = max_model_len
        self.max_len = self.pages_per_row * page_size  # slots reserved per row
        self.eos_token_id = eos_token_id
        self.prefill_buckets = pow2_buckets(page_size, self.max_len)  # S: padded prompt length
        self.kv_buckets = pow2_buckets(page_size, self.max_len)  # L: key positions a decode reads
        # Rows per prefill call for each S: as many as fit in max_prefill_tokens (at least one).
        self.prefill_rows = {s: max(1, min(batch_size, max_prefill_tokens // s)) for s in self.prefill_buckets}

        dtype = jnp.dtype(model_config.dtype)
        self.params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
        c = model_config
        self.num_pages = batch_size * self.pages_per_row
        self.kv_pages = jnp.zeros(
            (c.num_layers, 2, c.num_kv_heads, self.num_pages, page_size, c.head_dim), dtype
        )
        self.num_compiles = 0  # traces of the step functions
        self._prefill = {s: self._jit(kv_len=s, gather_rows=True) for s in self.prefill_buckets}
        self._decode = {l: self._jit(kv_len=l, gather_rows=False) for l in self.kv_buckets}
        self.timings = {"schedule": 0.0, "prepare": 0.0, "device": 0.0, "postprocess": 0.0}

    def _jit(self, *, kv_len: int, gather_rows: bool) -> Callable:
        attention = functools.partial(
            dense_attention, pages_per_row=self.pages_per_row, kv_len=kv_len, gather_rows=gather_rows
        )
        model = CausalLM(self.config, attention)

        def step(params, kv_pages, token_ids, positions, slot_mapping, row_pages, seq_lens, logits_indices):
            self.num_compiles += 1  # runs only while tracing
            num_rows = seq_lens.shape[0]
            query_start_loc = jnp.arange(num_rows + 1, dtype=jnp.int32) * (token_ids.shape[0] // num_rows)
            return model.apply(
                params, kv_pages, token_ids, positions, slot_mapping, row_pages, seq_lens,
                query_start_loc, logits_indices,
            )

        return jax.jit(step, donate_argnames=("kv_pages",))

    # ---------------------------------------------------------------- device calls

    def _bucket(self, buckets: Sequence[int], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def _prefill_inputs(self, rows: Sequence[int], prompts: Sequence[list[int]]) -> tuple[int, tuple]:
        """Host arrays putting `prompts[i]` into cache row `rows[i]`: (S, arrays for the step)."""
        s = self._bucket(self.prefill_buckets, max(len(p) for p in prompts))
        num_rows = self.prefill_rows[s]
        token_ids = np.zeros((num_rows, s), np.int32)
        slot_mapping = np.full((num_rows, s), self.num_pages * self.page_size, np.int32)  # dropped
        seq_lens = np.zeros(num_rows, np.int32)  # padding rows: 0, they see nothing
        row_pages = np.zeros((num_rows, 1), np.int32)
        logits_indices = np.zeros(num_rows, np.int32)
        for r, (row, prompt) in enumerate(zip(rows, prompts)):
            n = len(prompt)
            token_ids[r, :n] = prompt
            slot_mapping[r, :n] = row * self.max_len + np.arange(n)
            seq_lens[r] = s  # rectangle: queries at positions 0..s-1 (the tail is padding)
            row_pages[r, 0] = row * self.pages_per_row
            logits_indices[r] = r * s + n - 1
        positions = np.tile(np.arange(s, dtype=np.int32), num_rows)
        return s, (token_ids.reshape(-1), positions, slot_mapping.reshape(-1), row_pages, seq_lens, logits_indices)

    def _run_prefill(self, s: int, arrays: tuple):
        logits, self.kv_pages = self._prefill[s](self.params, self.kv_pages, *arrays)
        return logits

    def _decode_inputs(self, token_ids, positions, write) -> tuple[int, tuple]:
        """One token for every row; `write[b]` False drops row b's K/V write (finished rows)."""
        b = np.arange(self.batch_size, dtype=np.int32)
        slot_mapping = np.where(write, b * self.max_len + positions, self.num_pages * self.page_size)
        kv_len = self._bucket(self.kv_buckets, int(positions.max()) + 1)
        row_pages = (b * self.pages_per_row)[:, None]
        return kv_len, (token_ids, positions, slot_mapping.astype(np.int32), row_pages, positions + 1, b)

    def _run_decode(self, kv_len: int, arrays: tuple):
        logits, self.kv_pages = self._decode[kv_len](self.params, self.kv_pages, *arrays)
        return logits

    def warmup(self, max_prompt_len: int | None = None, max_seq_len: int | None = None) -> None:
        """Compiles the prefill and decode buckets and their samplers, so serving never compiles.

        By default every bucket; given the longest prompt and the longest sequence (prompt + output)
        a workload can have, only the buckets it can reach.
        """
        rows = [RowSpec(row_idx=0, temperature=1.0, top_k=2, top_p=0.9, seed=0, step=0)]
        top_s = self._bucket(self.prefill_buckets, min(max_prompt_len or self.max_len, self.max_len))
        for s in (b for b in self.prefill_buckets if b <= top_s):
            logits = self._run_prefill(*self._prefill_inputs([0], [[0] * s]))
            jax.block_until_ready(sample(logits, make_sampling_arrays(rows, logits.shape[0])))
        top_l = self._bucket(self.kv_buckets, min(max_seq_len or self.max_len, self.max_len))
        zeros = np.zeros(self.batch_size, np.int32)
        no_write = np.zeros(self.batch_size, bool)
        for kv_len in (b for b in self.kv_buckets if b <= top_l):
            logits = self._run_decode(*self._decode_inputs(zeros, zeros + (kv_len - 1), no_write))
            jax.block_until_ready(sample(logits, make_sampling_arrays(rows, logits.shape[0])))

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        on_step: Callable[[DenseStep], None] | None = None,
    ) -> list[DenseOutput]:
        """Serves the prompts in arrival order, `batch_size` at a time; one DenseOutput per prompt.

        `on_step` is called after every device step (the benchmark records time and memory there).
        Requests with `params.seed` None draw with seed = their index, so runs are reproducible.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not prompt or len(prompt) + p.max_tokens > self.max_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens and asks for {p.max_tokens} more, but a row holds "
                    f"{self.max_len}; raise max_model_len or shorten the request"
                )
            if p.n != 1 or p.stop:
                raise ValueError("the dense baseline serves n=1 without stop strings; drop them for the benchmark")
        outputs = [DenseOutput(list(p), []) for p in prompts]
        for start in range(0, len(prompts), self.batch_size):
            idx = list(range(start, min(start + self.batch_size, len(prompts))))
            self._serve_batch(idx, prompts, params, outputs, on_step)
        return outputs

    def _row_spec(self, row: int, request_idx: int, p: SamplingParams, step: int) -> RowSpec:
        """The engine's row rules (planner/request.py): the folded seed, the min_tokens stop-token mask."""
        eos = () if p.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        return RowSpec(row_idx=row, temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p, min_p=p.min_p,
                       seed=seed_for(p.seed if p.seed is not None else request_idx, 0), step=step,
                       banned_ids=banned_token_ids(frozenset((*p.stop_token_ids, *eos)), step, p.min_tokens))

    def _accept(self, out: DenseOutput, p: SamplingParams, token: int, now: float) -> bool:
        """Appends a sampled token and applies the token-level stop rules; True when finished."""
        out.token_ids.append(token)
        if out.first_token_time is None:
            out.first_token_time = now
        n = len(out.token_ids)
        if n >= p.max_tokens:
            out.finish_reason = "length"
        elif n >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id)
        ):
            out.finish_reason = "stop"
        if out.finish_reason is not None:
            out.finish_time = now
            return True
        return False

    def _serve_batch(self, idx, prompts, params, outputs, on_step) -> None:
        b = len(idx)
        reserved = self.batch_size * self.max_len
        done = np.zeros(self.batch_size, bool)
        done[b:] = True  # rows beyond a short last batch are padding from the start
        lens = np.zeros(self.batch_size, np.int32)  # tokens of each row held in the cache

        # Prefill: rows sorted by prompt length, grouped by padded length S (as many as fit a call),
        # so that short prompts are not padded to the longest one.
        t0 = time.perf_counter()
        groups: list[list[int]] = []
        group_s = None
        for r in sorted(range(b), key=lambda r: len(prompts[idx[r]])):
            s = self._bucket(self.prefill_buckets, len(prompts[idx[r]]))
            if s == group_s and len(groups[-1]) < self.prefill_rows[s]:
                groups[-1].append(r)
            else:
                groups.append([r])
                group_s = s
        for group in groups:
            t1 = time.perf_counter()
            group_prompts = [prompts[idx[r]] for r in group]
            s, arrays = self._prefill_inputs(group, group_prompts)
            specs = [self._row_spec(i, idx[r], params[idx[r]], 0) for i, r in enumerate(group)]
            sampling = make_sampling_arrays(specs, self.prefill_rows[s])
            t2 = time.perf_counter()
            tokens = np.asarray(sample(self._run_prefill(s, arrays), sampling)[0])
            t3 = time.perf_counter()
            for i, r in enumerate(group):
                lens[r] = len(group_prompts[i])
                done[r] = self._accept(outputs[idx[r]], params[idx[r]], int(tokens[i]), t3)
            self._add_timings(t0, t1, t2, t3)
            if on_step:
                on_step(DenseStep("prefill", sum(map(len, group_prompts)), len(arrays[0]), int((~done).sum()),
                                  int(lens[~done].sum()), reserved, len(group)))
            t0 = time.perf_counter()

        # Decode all rows together until the slowest sequence finishes.
        last = np.zeros(self.batch_size, np.int32)
        for r in range(b):
            last[r] = outputs[idx[r]].token_ids[-1]
        while not done.all():
            t1 = time.perf_counter()
            write = ~done
            running = np.flatnonzero(write).tolist()  # Python ints: the rows as _row_spec takes them
            kv_len, arrays = self._decode_inputs(last, np.where(write, lens, 0).astype(np.int32), write)
            specs = [self._row_spec(r, idx[r], params[idx[r]], len(outputs[idx[r]].token_ids)) for r in running]
            sampling = make_sampling_arrays(specs, self.batch_size)
            t2 = time.perf_counter()
            tokens = np.asarray(sample(self._run_decode(kv_len, arrays), sampling)[0])
            t3 = time.perf_counter()
            for i, r in enumerate(running):
                lens[r] += 1
                last[r] = tokens[i]
                done[r] = self._accept(outputs[idx[r]], params[idx[r]], int(tokens[i]), t3)
            self._add_timings(t1, t1, t2, t3)
            if on_step:
                on_step(DenseStep("decode", len(running), self.batch_size, int((~done).sum()),
                                  int(lens[~done].sum()), reserved, len(running)))

    def _add_timings(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """schedule: t0..t1, prepare: t1..t2 (host arrays), device: t2..t3 (dispatch to tokens back)."""
        self.timings["schedule"] += t1 - t0
        self.timings["prepare"] += t2 - t1
        self.timings["device"] += t3 - t2
        self.timings["postprocess"] += time.perf_counter() - t3
