"""`/metrics`' page gauges are the engine's own numbers, in bytes that count the KV dtype.

At b8feddf the server sized `jaxpaged_kv_used_bytes` with the float page, 3.76x too high on an int8
cache. Here each KV dtype's engine holds pages for two unfinished requests while the metrics are
scraped, and every page gauge is checked against `stats()` and bytes computed from first principles.
"""

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tp_fixtures
from jaxpaged.entrypoints.serve import build_server
from jaxpaged.planner.request import SamplingParams

TINY = tp_fixtures.TINY
# Bytes of one (token, KV head): head_dim values, plus a float32 scale when quantized.
TOKEN_HEAD_BYTES = {"auto": TINY.head_dim * 4, "int8": TINY.head_dim + 4, "float8_e4m3fn": TINY.head_dim + 4}


def _scrape(metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "float8_e4m3fn"])
def test_page_gauges_equal_stats_and_real_bytes(kv_cache_dtype):
    engine = tp_fixtures.make_engine(tp_fixtures.tiny_params(), kv_cache_dtype=kv_cache_dtype, warmup=False)
    _, bridge = build_server(engine, served_model_name="tiny")
    rng = np.random.default_rng(0)
    for n in (20, 9):  # 3 + 2 pages of 8 slots once both prompts are computed
        engine.add_request(rng.integers(0, TINY.vocab_size, n).tolist(), SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    bridge.metrics.publish(engine)
    got, stats = _scrape(bridge.metrics), engine.stats()

    page_bytes = TINY.num_layers * 2 * TINY.num_kv_heads * tp_fixtures.PAGE_SIZE * TOKEN_HEAD_BYTES[kv_cache_dtype]
    assert stats["num_used_pages"] >= 5
    assert got["jaxpaged_kv_used_bytes"] == stats["num_used_pages"] * page_bytes
    assert got["jaxpaged_kv_pages_used"] == stats["num_used_pages"]
    assert got["jaxpaged_kv_pages_free"] == stats["num_free_pages"]
    assert got["jaxpaged_kv_pages_total"] == stats["num_pages"]
    assert got["jaxpaged_kv_usage_ratio"] == pytest.approx(stats["num_used_pages"] / stats["num_pages"])
