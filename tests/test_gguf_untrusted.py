"""GGUF files from strangers (issue 53 item 5): a corrupt or hostile header gives a ValueError that
names the problem, never a crash, a hang or a huge allocation. A small GGUF is written with the
`gguf` package, then its header is mutated: targeted lies (counts, lengths, ranks, offsets,
alignment) and, with hypothesis, random bytes and truncations."""

import os
import struct
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.models.gguf import open_gguf


def _write_small_gguf(path: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "cd"])
    writer.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.125])
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small_gguf():
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "small.gguf")
    _write_small_gguf(path)
    with open(path, "rb") as f:
        return path, f.read()


def _parse(data: bytes):
    """open_gguf over `data` written to a file: the GGUFFile, or the ValueError it raised."""
    with tempfile.NamedTemporaryFile(suffix=".gguf", delete=False) as f:
        f.write(data)
    try:
        started = time.monotonic()
        try:
            result = open_gguf(f.name)
            for tensor in result.tensors:  # every tensor's bytes lie inside the file
                assert tensor.data.size == 0 or np.asarray(tensor.data).size == tensor.data.size
        except ValueError as err:
            result = err
        assert time.monotonic() - started < 5, "parsing took too long"
        return result
    finally:
        os.unlink(f.name)


def test_the_small_file_parses(small_gguf):
    path, _ = small_gguf
    parsed = open_gguf(path)
    assert parsed.metadata["tokenizer.ggml.tokens"] == ["a", "b", "cd"]
    names = {t.name: t for t in parsed.tensors}
    np.testing.assert_array_equal(np.asarray(names["token_embd.weight"].data).view(np.float32).reshape(4, 8),
                                  np.arange(32, dtype=np.float32).reshape(4, 8))


def _header_offsets(data: bytes) -> dict:
    """Byte offsets of the fields the targeted lies overwrite (walks the small file's header)."""
    pos, offsets = 24, {"tensor_count": 8, "kv_count": 16}
    kv_count = struct.unpack_from("<Q", data, 16)[0]
    for _ in range(kv_count):
        (n,) = struct.unpack_from("<Q", data, pos)
        offsets.setdefault("key_length", pos)
        pos += 8 + n
        (value_type,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if value_type == 9:
            item_type, count = struct.unpack_from("<IQ", data, pos)
            offsets.setdefault("array_count", pos + 4)
            pos += 12
            for _ in range(count):
                if item_type == 8:
                    (n,) = struct.unpack_from("<Q", data, pos)
                    pos += 8 + n
                else:
                    pos += 4
        elif value_type == 8:
            (n,) = struct.unpack_from("<Q", data, pos)
            pos += 8 + n
        else:
            pos += 4
    (n,) = struct.unpack_from("<Q", data, pos)
    pos += 8 + n
    offsets["n_dims"] = pos
    (n_dims,) = struct.unpack_from("<I", data, pos)
    offsets["dim0"] = pos + 4
    offsets["qtype"] = pos + 4 + 8 * n_dims
    offsets["offset"] = pos + 8 + 8 * n_dims
    return offsets


@pytest.mark.parametrize("field, fmt, value, words", [
    ("tensor_count", "<Q", 2**63, "cannot fit"),
    ("kv_count", "<Q", 2**40, "cannot fit"),
    ("key_length", "<Q", 2**62, "past the file's end"),
    ("array_count", "<Q", 2**61, "claims"),
    ("n_dims", "<I", 2**32 - 1, "dimensions"),
    ("dim0", "<Q", 2**60, "ends past the file's end"),
    ("qtype", "<I", 999, "unknown data type"),
    ("offset", "<Q", 2**50, "ends past the file's end"),
])
def test_a_lie_in_the_header_is_a_value_error_naming_it(small_gguf, field, fmt, value, words):
    _, data = small_gguf
    mutated = bytearray(data)
    struct.pack_into(fmt, mutated, _header_offsets(data)[field], value)
    err = _parse(bytes(mutated))
    assert isinstance(err, ValueError) and words in str(err), err


def test_truncated_and_empty_files_are_value_errors(small_gguf):
    _, data = small_gguf
    for length in (0, 3, 10, 30, _header_offsets(data)["offset"], len(data) // 2):
        assert isinstance(_parse(data[:length]), ValueError), length


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_header_bytes_parse_or_raise_value_error(small_gguf, data):
    """Any mutation of the header region (and the tensor infos) either still parses or raises
    ValueError: never struct.error, IndexError, OverflowError, MemoryError or a hang."""
    _, original = small_gguf
    mutated = bytearray(original)
    header_end = _header_offsets(original)["offset"] + 8
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, header_end - 1))
        mutated[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    _parse(bytes(mutated))  # asserts inside: a GGUFFile or a ValueError, quickly
