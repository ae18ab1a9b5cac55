"""The soak under faults (jaxpaged/baseline/soak.py) against the OpenAI server on 127.0.0.1, over a
tiny random model: per round 64 requests opened at once with client disconnects, malformed bodies, a
weight update and a pause(abort) + sleep + wake in the middle; latency p50/p99 of the requests
answered, RSS after every round, requests and KV pages left behind.

    python -m benchmarks.bench_soak [--rounds 8] [--streams 64] [--max-tokens 32] \
        [--json benchmarks/results/soak_cpu.json]

The server runs in this process (its engine thread, uvicorn's loop in a thread, the load generator's
loop in the main thread), so the RSS is the server's plus the client's. Round 0 warms up (compiles);
latency and RSS growth are taken over the rounds after it. The latencies are those of a 2-layer
random model on a shared CPU under a pause and a weight update each round: they show the faults'
cost and the tail, not the engine's speed.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import environment, format_table, write_report


def build_engine(max_tokens: int):
    import jax

    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn
    from jaxpaged.engine.build import engine_from_parts
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.llama import init_params
    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer

    model = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    config = EngineConfig(page_size=16, num_pages=512, max_num_seqs=16, max_num_batched_tokens=256,
                          max_model_len=64 + max_tokens, warmup=True).resolved(on_gpu=False, model_max_len=512)
    engine = engine_from_parts(model, init_params(model, jax.random.key(0)), Tokenizer.from_gguf(default_model_path()),
                               config, num_pages=config.num_pages, attention_fn=attention_fn("chunked"))
    return engine, init_params(model, jax.random.key(1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default="benchmarks/results/soak_cpu.json")
    args = p.parse_args(argv)

    from jaxpaged.baseline.soak import SoakPlan, run_soak, serving, sleep_wake_event, update_weights_event

    started = time.perf_counter()
    engine, new_params = build_engine(args.max_tokens)
    plan = SoakPlan(num_streams=args.streams, num_rounds=args.rounds, max_tokens=args.max_tokens)
    events = [update_weights_event(lambda: new_params, after_first_tokens=8),
              sleep_wake_event(after_answered=args.streams // 4)]
    with serving(engine, served_model_name="tiny") as (base, bridge):
        report = run_soak(base, "tiny", bridge, plan, events)
    report["environment"] = environment()
    report["wall_s"] = time.perf_counter() - started

    rows = [{"round": i, **r["outcomes"], "pages": r["leaks"]["num_used_pages"],
             "in_flight": r["leaks"]["num_in_flight"] + r["leaks"]["num_requests"], "rss_mib": r["rss_mib"],
             "p50_s": r["latency_s"]["p50"], "p99_s": r["latency_s"]["p99"], "ttft_p50_s": r["ttft_s"]["p50"],
             "s": r["seconds"]} for i, r in enumerate(report["rounds"])]
    print(format_table(rows, [("round", "round"), ("answered", "answered"), ("aborted", "aborted"),
                              ("disconnected", "disconnected"), ("refused", "refused"), ("failed", "failed"),
                              ("pages left", "pages"), ("requests left", "in_flight"), ("RSS MiB", "rss_mib"),
                              ("p50 s", "p50_s"), ("p99 s", "p99_s"), ("TTFT p50 s", "ttft_p50_s"),
                              ("round s", "s")]))
    print(f"after warm-up: latency p50 {report['latency_s']['p50']:.3f} s, p99 {report['latency_s']['p99']:.3f} s; "
          f"TTFT p50 {report['ttft_s']['p50']:.3f} s, p99 {report['ttft_s']['p99']:.3f} s; RSS growth "
          f"{100 * report['rss_growth']:+.1f}%; failures {report['num_failures']}; no leaks after every round: "
          f"{report['leaks_after_every_round']} (measured on {report['environment']['processor']}, "
          f"{report['environment']['cpu_count']} CPUs)")
    if args.json:
        write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
