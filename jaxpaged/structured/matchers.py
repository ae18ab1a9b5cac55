"""Per-sequence grammar matchers and the step's token bitmask (host side).

    admission ──► templates[request_id] = template (the request's compiled matcher, grammar.py)
    dispatch  ──► bitmask(rows, num_rows)          int32 [num_rows, ceil(vocab / 32)]: bit t of row r
                  = token t allowed; rows without a grammar all ones (-1). Each constrained row's
                  matcher first consumes the sequence's output tokens it has not seen (catch-up).
    commit    ──► release(live request ids)        matchers of finished sequences are dropped

A step with a constrained row is committed in the same engine step (engine.py), so at dispatch every
output token of a constrained sequence has landed: catch-up never meets a placeholder. A sample of
an n > 1 request starts from its own copy of the template (forked children included); preemption
keeps the matcher, since a preempted sequence keeps its output tokens. Pure host code, no jax.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy as llnp
import numpy as np


class StructuredState:
    def __init__(self, vocab_size: int, eos_token_id: int | None, num_threads: int | None = None):
        self.num_words = (vocab_size + 31) // 32
        self.eos_token_id = eos_token_id
        self.templates: dict[str, llguidance.LLMatcher] = {}  # request_id -> its compiled template
        self._matchers: dict[int, list] = {}  # seq_id -> [seq, matcher, output tokens consumed]
        self._executor = llguidance.LLExecutor(num_threads)

    def __len__(self) -> int:
        """Matchers and templates held (0 once every constrained request finished: no leak)."""
        return len(self._matchers) + len(self.templates)

    def _matcher(self, seq, request_id: str):
        entry = self._matchers.get(seq.seq_id)
        if entry is None:  # each sample (forked ones included) starts from its own copy
            entry = self._matchers[seq.seq_id] = [seq, self.templates[request_id].deep_copy(), 0]
        seq, matcher, consumed = entry
        outputs = seq.output_token_ids[consumed:]
        if outputs:
            matcher.consume_tokens([int(t) for t in outputs])
            entry[2] += len(outputs)
        return matcher

    def bitmask(self, rows: list[tuple[int, object, str]], num_rows: int) -> np.ndarray:
        """The step's mask: each (sampler row, sequence, request id) of `rows` gets its sequence's
        allowed tokens; a row whose matcher allows nothing (it ended under ignore_eos) gets eos."""
        mask = np.full((num_rows, self.num_words), -1, np.int32)
        first_row: dict[int, int] = {}  # seq_id -> its first row (n > 1 first tokens share a state)
        pairs, copies = [], []
        for row, seq, request_id in rows:
            if seq.seq_id in first_row:
                copies.append((row, first_row[seq.seq_id]))
            else:
                first_row[seq.seq_id] = row
                pairs.append((self._matcher(seq, request_id), row))
        llnp.fill_next_token_bitmask_par(self._executor, pairs, mask)
        for row, source in copies:
            mask[row] = mask[source]
        if self.eos_token_id is not None:
            for row, _, _ in rows:
                if not mask[row].any():
                    mask[row, self.eos_token_id // 32] = np.uint32(1 << (self.eos_token_id % 32)).view(np.int32)
        return mask

    def release(self, live_request_ids) -> None:
        """Drops the matchers of finished sequences and the templates of requests not in live_request_ids."""
        for seq_id in [s for s, (seq, _, _) in self._matchers.items() if seq.is_finished]:
            del self._matchers[seq_id]
        for request_id in [r for r in self.templates if r not in live_request_ids]:
            del self.templates[request_id]
