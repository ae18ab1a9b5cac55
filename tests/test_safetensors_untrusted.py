"""safetensors files from strangers (issue 53 item 5): a corrupt header (its length, its JSON, a
tensor's dtype, shape or offsets) is a ValueError naming the problem, never a crash, a hang or a
huge allocation; random header mutations too (hypothesis)."""

import json
import os
import struct
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.models.loading import read_safetensors


def _file(header: dict, data: bytes, header_len: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def _valid() -> tuple[dict, bytes]:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones(4, ml_dtypes.bfloat16)
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}
    return header, a.tobytes() + b.tobytes()


def _read(blob: bytes):
    with tempfile.NamedTemporaryFile(suffix=".safetensors", delete=False) as f:
        f.write(blob)
    try:
        try:
            return read_safetensors(f.name)
        except ValueError as err:
            return err
    finally:
        os.unlink(f.name)


def test_a_valid_file_reads_with_its_bf16_tensor():
    header, data = _valid()
    out = _read(_file(header, data))
    np.testing.assert_array_equal(out["a"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert out["b"].dtype == ml_dtypes.bfloat16 and out["b"].tolist() == [1.0] * 4


@pytest.mark.parametrize("make, words", [
    (lambda h, d: b"\x01\x02", "fewer than its 8-byte header length"),
    (lambda h, d: _file(h, d, header_len=2**62), "header claims"),
    # Past the file's end by one byte, far under the size cap: refused by the file's size, not read.
    (lambda h, d: _file(h, d, header_len=len(json.dumps(h)) + len(d) + 1), "header claims"),
    (lambda h, d: struct.pack("<Q", 5) + b"{nope" + d, "not JSON"),
    (lambda h, d: _file({**h, "a": {**h["a"], "data_offsets": [0, 2**40]}}, d), "corrupt safetensors"),
    (lambda h, d: _file({**h, "b": {**h["b"], "shape": [2**31, 2**31]}}, d), "corrupt safetensors"),
    (lambda h, d: _file({**h, "a": {**h["a"], "dtype": "Q9"}}, d), "corrupt safetensors"),
])
def test_a_lie_in_the_header_is_a_value_error(make, words):
    header, data = _valid()
    err = _read(make(header, data))
    assert isinstance(err, ValueError) and words in str(err), err


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_header_bytes_read_or_raise_value_error(data):
    header, payload = _valid()
    blob = bytearray(_file(header, payload))
    header_end = len(blob) - len(payload)
    for _ in range(data.draw(st.integers(1, 6))):
        blob[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    _read(bytes(blob))  # a dict of arrays or a ValueError; anything else fails the test
