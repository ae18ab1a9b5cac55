"""A burst: N chat streams opened at once against `python -m jaxpaged.serve`, per server configuration
(issue 30 item 7: at b8feddf 32 concurrent streams waited up to 28 s for a first token behind the
default max_num_seqs=16).

    python -m benchmarks.bench_burst                                   # --max-num-seqs 16, then the default
    python -m benchmarks.bench_burst --configs "" "--max-num-seqs 16" --num-streams 32

For each configuration the script starts the server on the bundled SmolLM2, waits for one answered
request, opens the streams together (greedy chat, max_tokens 48), and reports the time to first
token (median, max), the wall time, and the server's own `jaxpaged_request_queue_time_seconds` (sum
and count: time from arrival to first admission). Results: benchmarks/results/burst_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from servers import free_port, stop_server, wait_ready  # noqa: E402
from common import environment, format_table, percentile  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello.",
             "Describe the sea in one sentence.", "Give me a fruit.", "What is a cat?", "Count to five."]


async def one_stream(client: httpx.AsyncClient, url: str, i: int) -> float | None:
    """Seconds to the first streamed content of chat request i (None if none came), read to its end."""
    body = {"messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "max_tokens": 48, "temperature": 0.0, "stream": True}
    t0, first = time.perf_counter(), None
    async with client.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                first = time.perf_counter() - t0
    return first


async def burst(url: str, num_streams: int) -> list[float | None]:
    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*[one_stream(client, url, i) for i in range(num_streams)])


def run_config(flags: list[str], num_streams: int, timeout_s: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged.serve", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        start_s = wait_ready(base, proc, None, timeout_s)
        t0 = time.perf_counter()
        ttft = asyncio.run(burst(base + "/v1/chat/completions", num_streams))
        wall = time.perf_counter() - t0
        metrics = httpx.get(base + "/metrics", timeout=30).text
    finally:
        stop_server(proc)
    log.seek(0)
    config_line = next((line for line in log.read().splitlines() if " serving " in line), "")
    got = [t for t in ttft if t is not None]

    def metric(name):
        return float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))

    return {"flags": " ".join(flags) or "(defaults)", "config": config_line.split(": ", 1)[-1],
            "start_s": round(start_s, 1), "num_streams": num_streams, "num_answered": len(got),
            "ttft_median_s": round(percentile(got, 50), 2), "ttft_max_s": round(max(got), 2),
            "wall_s": round(wall, 1),
            # the warm-up request is in the histogram too: it never waited
            "queue_time_sum_s": round(metric("jaxpaged_request_queue_time_seconds_sum"), 1),
            "queue_time_count": int(metric("jaxpaged_request_queue_time_seconds_count"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["--max-num-seqs 16", ""],
                   help="server flag sets, one string each ('' = the defaults)")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for a server to start")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "burst_cpu.json"))
    args = p.parse_args(argv)
    rows = []
    for flags in args.configs:
        rows.append(run_config(shlex.split(flags), args.num_streams, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    print(format_table(rows, [("server flags", "flags"), ("TTFT median s", "ttft_median_s"),
                              ("TTFT max s", "ttft_max_s"), ("wall s", "wall_s"),
                              ("queue time sum s", "queue_time_sum_s"), ("start s", "start_s")]))
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "load_average": os.getloadavg(), "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
