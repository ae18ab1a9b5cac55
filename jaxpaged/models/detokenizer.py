"""Token ids in, text out, one token at a time: what streaming and stop strings read.

`Tokenizer.detokenizer()` (tokenizer.py) picks one: `ByteLevelDetokenizer` for byte-level BPE
(a byte table, ~20x cheaper per token), else `IncrementalDetokenizer` (decodes small windows).
Both emit exactly what `decode` gives for the whole output.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import tokenizers


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces, emitting only complete characters.

    One token can end in the middle of a UTF-8 character (an emoji is 4 bytes, often 2 tokens), and
    byte-level BPE may decode a token differently once its neighbour is known. So each step decodes
    a small window twice and emits the difference:

        token_ids:  ... p p p r r r n      (p: prefix context, r: already emitted, n: new)
                        ^prefix   ^read
        before = decode(ids[prefix:read]);  after = decode(ids[prefix:])
        emit after[len(before):] unless it ends in U+FFFD (an unfinished character: wait)

    Invariant: the concatenation of everything emitted equals `decode(output ids)` once the
    sequence ends (`flush()` emits a trailing unfinished character as U+FFFD, as `decode` does).
    """

    tokenizer: Any  # a Tokenizer (tokenizer.py): .decode(ids, skip_special_tokens)
    token_ids: list[int]
    skip_special_tokens: bool = True
    prefix_idx: int = field(init=False)
    read_idx: int = field(init=False)

    def __post_init__(self):
        # Start the window a few tokens back in the prompt so the first output token decodes with
        # its left context (a leading space is spelled by the token, not added by the decoder).
        self.read_idx = len(self.token_ids)
        self.prefix_idx = max(0, self.read_idx - 5)

    def step(self, token_id: int) -> str:
        """Append one token; return the new complete text (may be empty)."""
        self.token_ids.append(token_id)
        before = self.tokenizer.decode(self.token_ids[self.prefix_idx : self.read_idx], self.skip_special_tokens)
        after = self.tokenizer.decode(self.token_ids[self.prefix_idx :], self.skip_special_tokens)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix_idx = self.read_idx
        self.read_idx = len(self.token_ids)
        return after[len(before) :]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Several tokens at once: the concatenation of `step` over them."""
        return "".join([self.step(t) for t in token_ids])

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an unfinished character decodes as U+FFFD)."""
        before = self.tokenizer.decode(self.token_ids[self.prefix_idx : self.read_idx], self.skip_special_tokens)
        after = self.tokenizer.decode(self.token_ids[self.prefix_idx :], self.skip_special_tokens)
        self.prefix_idx = self.read_idx
        self.read_idx = len(self.token_ids)
        return after[len(before) :]


def _gpt2_char_to_byte() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: printable bytes spell themselves, the other 68 bytes are
    spelled by the code points 256, 257, ... in byte order (' ' is 'Ġ', U+0120)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def byte_level_table(backend: tokenizers.Tokenizer) -> tuple[list[bytes], frozenset[int]]:
    """Each token id's bytes as the ByteLevel decoder produces them, and the special token ids.

    The decoder maps each character of a token's spelling through the byte alphabet; a token with
    a character outside it (an added token such as a chat marker in another script) is taken as its
    own UTF-8 text.
    """
    char_to_byte = _gpt2_char_to_byte()
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    table = []
    for token_id in range(vocab_size):
        spelling = backend.id_to_token(token_id) or ""
        try:
            table.append(bytes(char_to_byte[c] for c in spelling))
        except KeyError:
            table.append(spelling.encode("utf-8"))
    special = frozenset(i for i, added in backend.get_added_tokens_decoder().items() if added.special)
    return table, special


class ByteLevelDetokenizer:
    """Streams a byte-level BPE's output: token bytes into an incremental UTF-8 decoder.

    An unfinished character stays in the decoder until its last byte arrives; `flush()` renders a
    character that never finished as U+FFFD, as `decode` does. No window is decoded twice, and the
    prompt is not needed: a byte-level token spells its own leading space.
    """

    __slots__ = ("_token_bytes", "_skip_ids", "_utf8")

    def __init__(self, token_bytes: list[bytes], skip_ids: frozenset[int]):
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def step(self, token_id: int) -> str:
        """Append one token; return the new complete text (may be empty)."""
        if token_id in self._skip_ids or token_id >= len(self._token_bytes):
            return ""  # a special token, or an id of the model's padded vocabulary past the tokenizer's
        return self._utf8.decode(self._token_bytes[token_id])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Several tokens at once: the concatenation of `step` over them, in one UTF-8 decode."""
        table, skip = self._token_bytes, self._skip_ids
        num_known = len(table)
        return self._utf8.decode(b"".join([table[t] for t in token_ids if t < num_known and t not in skip]))

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an unfinished character decodes as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
