"""The device side of a step: scheduler output -> padded `StepInput` -> one jitted, donated step.

    host (numpy)                                   device (one jitted function per bucket)
    SchedulerOutput --prepare_step_input--> StepInput --ModelRunner.execute--> logits [num_seqs, vocab]
                                                         kv_pages donated in, updated buffer out

Shapes come from a small fixed list of buckets, so after `warmup()` no step compiles again.
"""

import dataclasses
import itertools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.attention import reference_paged_attention
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import AttentionFn, CausalLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step's host -> device contract (DESIGN.md): padded int32 arrays, shapes from a bucket.

    A bucket `b` fixes num_tokens = b and num_seqs = min(b, max_num_seqs).
    """

    # Flat tokens of all scheduled chunks, in batch order; padding 0.
    token_ids: Int[Array, "num_tokens"]
    # Each token's position in its sequence (RoPE); padding 0.
    positions: Int[Array, "num_tokens"]
    # Slot receiving each token's K/V (page_id * page_size + offset); padding num_pages * page_size.
    slot_mapping: Int[Array, "num_tokens"]
    # Physical page ids of each sequence, at fixed width ceil(max_model_len / page_size); padding 0.
    block_tables: Int[Array, "num_seqs pages_per_seq"]
    # Context length of each sequence after this step (cached + new tokens); padding rows 0.
    seq_lens: Int[Array, "num_seqs"]
    # Sequence i owns tokens query_start_loc[i]:query_start_loc[i+1]; padding rows repeat the total.
    query_start_loc: Int[Array, "num_seqs_plus_1"]
    # Flat index of each sequence's last scheduled token (where logits are taken); padding rows 0.
    logits_indices: Int[Array, "num_seqs"]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def default_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `max_num_batched_tokens` (always included)."""
    buckets = []
    b = smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return (*buckets, max_num_batched_tokens)


def prepare_step_input(
    scheduler_output,
    *,
    page_size: int,
    num_pages: int,
    pages_per_seq: int,
    max_num_seqs: int,
    buckets: Sequence[int],
) -> StepInput:
    """Turns the scheduler's step description into a padded `StepInput` of numpy int32 arrays.

    `scheduler_output` needs `.seqs` (each with `.token_ids`, `.num_computed_tokens`,
    `.block_table`) and `.num_new_tokens`. Worked example, page_size 4, two sequences:

        seq A: 5 tokens cached, 3 new (a prefill chunk), block_table [2, 7]
        seq B: 9 cached, 1 new (a decode),              block_table [4, 9, 1]

        token:            0     1     2   |  3
        positions:        5     6     7   |  9
        page, offset:   (7,1) (7,2) (7,3) | (1,1)     page = block_table[pos // 4], offset = pos % 4
        slot_mapping:    29    30    31   |  5        slot = page * 4 + offset
        query_start_loc: [0, 3, 4],  seq_lens: [8, 10],  logits_indices: [2, 3]
    """
    seqs, num_new = scheduler_output.seqs, np.asarray(scheduler_output.num_new_tokens, np.int32)
    num_seqs, total = len(seqs), int(num_new.sum())
    if num_seqs == 0:
        raise ValueError("the step schedules no sequence; do not call the model for an empty step")
    if num_seqs > max_num_seqs:
        raise ValueError(f"{num_seqs} sequences exceed {max_num_seqs=}; the scheduler must cap them")
    if np.any(num_new < 1):
        raise ValueError(f"every scheduled sequence needs >= 1 new token, got {num_new.tolist()}")
    bucket = next((b for b in sorted(buckets) if b >= total), None)
    if bucket is None:
        raise ValueError(f"{total} tokens exceed the largest bucket {max(buckets)}; raise it or schedule fewer")
    bucket_seqs = min(bucket, max_num_seqs)

    start = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, num_seqs)
    seq_lens = start + num_new
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(num_new, out=query_start_loc[1:])

    # Block tables, each padded with page 0 to pages_per_seq: fill a row-major mask in one go.
    table_lens = np.fromiter((len(s.block_table) for s in seqs), np.int32, num_seqs)
    if np.any(table_lens * page_size < seq_lens) or np.any(table_lens > pages_per_seq):
        bad = int(np.argmax((table_lens * page_size < seq_lens) | (table_lens > pages_per_seq)))
        raise ValueError(
            f"sequence {bad} needs {seq_lens[bad]} slots but its block table has {table_lens[bad]} pages "
            f"(at most {pages_per_seq}); the block manager must allocate pages before the step"
        )
    block_tables = np.zeros((bucket_seqs, pages_per_seq), np.int32)
    flat_pages = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs), np.int32, int(table_lens.sum())
    )
    block_tables[:num_seqs][np.arange(pages_per_seq) < table_lens[:, None]] = flat_pages

    # Per token: its sequence, its position, its slot.
    seq_idx = np.repeat(np.arange(num_seqs, dtype=np.int32), num_new)  # [total]
    positions = np.zeros(bucket, np.int32)
    positions[:total] = start[seq_idx] + np.arange(total, dtype=np.int32) - query_start_loc[seq_idx]
    slot_mapping = np.full(bucket, num_pages * page_size, np.int32)
    pos = positions[:total]
    slot_mapping[:total] = block_tables[seq_idx, pos // page_size] * page_size + pos % page_size

    token_ids = np.zeros(bucket, np.int32)
    if total == num_seqs:  # all decodes: one token each, no slicing
        token_ids[:total] = [s.token_ids[c] for s, c in zip(seqs, start.tolist())]
    else:
        token_ids[:total] = np.fromiter(
            itertools.chain.from_iterable(
                s.token_ids[c : c + n] for s, c, n in zip(seqs, start.tolist(), num_new.tolist())
            ),
            np.int32,
            total,
        )

    padded_lens = np.zeros(bucket_seqs, np.int32)
    padded_lens[:num_seqs] = seq_lens
    padded_starts = np.full(bucket_seqs + 1, total, np.int32)
    padded_starts[: num_seqs + 1] = query_start_loc
    logits_indices = np.zeros(bucket_seqs, np.int32)
    logits_indices[:num_seqs] = query_start_loc[1:] - 1
    return StepInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=padded_lens,
        query_start_loc=padded_starts,
        logits_indices=logits_indices,
    )


def enable_compilation_cache() -> str:
    """Turns on JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxpaged/xla)."""
    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.expanduser("~/.cache/jaxpaged/xla")
    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    return jax.config.jax_compilation_cache_dir


def kv_cache_bytes_per_page(config: ModelConfig, page_size: int) -> int:
    """Bytes of one page across all layers, K and V."""
    return config.num_layers * 2 * config.num_kv_heads * page_size * config.head_dim * jnp.dtype(config.dtype).itemsize


def num_pages_for_budget(config: ModelConfig, page_size: int, budget_bytes: int) -> int:
    """How many pages (the padding page 0 included) fit in `budget_bytes` of KV memory."""
    num_pages = budget_bytes // kv_cache_bytes_per_page(config, page_size)
    if num_pages < 2:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {num_pages} pages of {page_size} tokens; "
            "at least 2 are needed (page 0 is padding): raise the budget or lower page_size"
        )
    return int(num_pages)


class ModelRunner:
    """Owns the parameters and the KV page buffer; runs one jitted step per `execute` call.

    The step is `(params, kv_pages, step_input) -> (logits, kv_pages)` with `kv_pages` donated:
    the buffer is updated in place and `self.kv_pages` always names the live one. Parameters are an
    argument (not a constant), so `update_params` swaps weights without recompiling.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        params,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention_fn: AttentionFn | None = None,
        buckets: Sequence[int] | None = None,
    ):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2: page 0 is the padding page")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(f"{max_num_seqs=} must be <= {max_num_batched_tokens=}: each sequence has >= 1 token")
        self.config = model_config
        self.num_pages, self.page_size = num_pages, page_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.pages_per_seq = math.ceil(max_model_len / page_size)
        self.buckets = tuple(sorted(buckets or default_buckets(max_num_batched_tokens)))
        if self.buckets[-1] < max_num_batched_tokens:
            raise ValueError(f"largest bucket {self.buckets[-1]} < {max_num_batched_tokens=}; add a bucket")
        enable_compilation_cache()

        self.model = CausalLM(model_config, attention_fn or reference_paged_attention)
        self.params = self._to_device(params)
        self._param_shapes = jax.tree.map(lambda x: (x.shape, x.dtype), self.params)
        c = model_config
        self.kv_pages = jnp.zeros(
            (c.num_layers, 2, c.num_kv_heads, num_pages, page_size, c.head_dim), c.dtype
        )
        # Copy-on-write copies run in their own small donated function, padded to max_num_seqs
        # pairs (the scheduler copies at most one page per sequence per step): most steps have
        # no copies and pay nothing, and StepInput stays the DESIGN.md contract.
        self.max_num_copies = max_num_seqs
        self.num_compiles = 0  # traces of the step function: each one is a compilation
        self.num_copy_compiles = 0  # the same for the page-copy function
        self._step = jax.jit(self._step_fn, donate_argnames=("kv_pages",))
        self._copy = jax.jit(self._copy_fn, donate_argnames=("kv_pages",))

    def _to_device(self, params):
        dtype = jnp.dtype(self.config.dtype)
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)

    def _step_fn(self, params, kv_pages, step_input: StepInput):
        self.num_compiles += 1  # runs only while tracing
        return self.model.apply(
            params, kv_pages, step_input.token_ids, step_input.positions, step_input.slot_mapping,
            step_input.block_tables, step_input.seq_lens, step_input.query_start_loc,
            step_input.logits_indices,
        )

    def _copy_fn(self, kv_pages, src, dst):
        self.num_copy_compiles += 1  # runs only while tracing
        return apply_page_copies(kv_pages, src, dst)

    def prepare(self, scheduler_output) -> StepInput:
        """`prepare_step_input` with this runner's page pool and buckets."""
        return prepare_step_input(
            scheduler_output, page_size=self.page_size, num_pages=self.num_pages,
            pages_per_seq=self.pages_per_seq, max_num_seqs=self.max_num_seqs, buckets=self.buckets,
        )

    def execute(self, step_input: StepInput) -> Float[Array, "num_seqs vocab_size"]:
        """Runs one step; returns float32 logits for every (padded) sequence row of the bucket."""
        logits, self.kv_pages = self._step(self.params, self.kv_pages, step_input)
        return logits

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies whole pages (all layers, K and V) `src -> dst`; call before the step that needs them."""
        for i in range(0, len(copies), self.max_num_copies):
            chunk = np.asarray(copies[i : i + self.max_num_copies], np.int32).reshape(-1, 2)
            src = np.zeros(self.max_num_copies, np.int32)
            dst = np.full(self.max_num_copies, self.num_pages, np.int32)  # out of range: dropped
            src[: len(chunk)], dst[: len(chunk)] = chunk[:, 0], chunk[:, 1]
            self.kv_pages = self._copy(self.kv_pages, src, dst)

    def run(self, scheduler_output) -> Float[Array, "num_seqs vocab_size"]:
        """Copy-on-write copies, then the step: the whole device side of one `SchedulerOutput`."""
        if scheduler_output.copies:
            self.copy_pages(scheduler_output.copies)
        return self.execute(self.prepare(scheduler_output))

    def dummy_step_input(self, bucket: int) -> StepInput:
        """An all-padding step of `bucket` tokens: it writes nothing and reads nothing."""
        num_seqs = min(bucket, self.max_num_seqs)
        zeros = np.zeros(bucket, np.int32)
        return StepInput(
            token_ids=zeros, positions=zeros,
            slot_mapping=np.full(bucket, self.num_pages * self.page_size, np.int32),
            block_tables=np.zeros((num_seqs, self.pages_per_seq), np.int32),
            seq_lens=np.zeros(num_seqs, np.int32), query_start_loc=np.zeros(num_seqs + 1, np.int32),
            logits_indices=np.zeros(num_seqs, np.int32),
        )

    def warmup(self) -> None:
        """Compiles the step for every bucket, and the page copy, so serving never compiles."""
        for bucket in self.buckets:
            self.execute(self.dummy_step_input(bucket)).block_until_ready()
        self.copy_pages([(0, self.num_pages)])  # a dropped copy: compiles, changes nothing

    def update_params(self, params) -> None:
        """Swaps in new weights of the same shapes and dtypes; the compiled step is reused."""
        params = self._to_device(params)
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), params)
        if jax.tree.structure(params) != jax.tree.structure(self.params) or shapes != self._param_shapes:
            raise ValueError(
                "new params differ in structure, shape or dtype from the current ones; "
                "build a new ModelRunner for a different model"
            )
        self.params = params

    def kv_cache_bytes(self) -> int:
        return self.kv_pages.nbytes


def apply_page_copies(
    kv_pages: Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"],
    src: Int[Array, "num_copies"],
    dst: Int[Array, "num_copies"],
) -> Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"]:
    """Copies page `src[i]` to page `dst[i]` in every layer, K and V, all pairs at once (reads
    see the buffer before any write). Padding pairs have dst = num_pages: out of range, dropped."""
    return kv_pages.at[:, :, :, dst].set(kv_pages[:, :, :, src], mode="drop")
