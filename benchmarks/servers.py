"""The OpenAI-compatible servers that bench_serving.py (S1) drives:
started as subprocesses on 127.0.0.1, waited for, stopped, and what they take from the CPU while idle.

jaxpaged (`python -m jaxpaged.serve` on the bundled GGUF, `jaxpaged-gguf` with its block codes kept),
Hugging Face (`transformers serve --continuous-batching` on a local directory converted from the same
GGUF) and vLLM (`benchmarks/peers/vllm_peer.py`, from its own venv), all with the same scheduler
limits (`SCHEDULER_LIMITS`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_directory(gguf_path: str, out_dir: str) -> str:
    """A local Hugging Face directory from the GGUF (`transformers serve` wants one; offline, no hub)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=name)
    model.config.architectures = [type(model).__name__]
    model.hf_quantizer = None  # the GGUF was dequantized on load; save plain weights
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


JAXPAGED_SYSTEMS = {"jaxpaged": [], "jaxpaged-gguf": ["--quantization", "gguf"],
                    "jaxpaged-gguf-q8": ["--quantization", "gguf", "--gguf-activations", "q8_1"]}
SCHEDULER_LIMITS = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]


def start_server(system: str, port: int, hf_dir: str | None, log_path: str, peers_dir: str | None = None,
                 vllm_threads_bind: str = "0-1") -> tuple[subprocess.Popen, str | None]:
    """Starts a server subprocess; returns it and the model name requests must carry."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if system in JAXPAGED_SYSTEMS:  # -gguf: the file's block codes kept (-q gguf); -gguf-q8: Q8_1 activations too
        cmd = [sys.executable, "-m", "jaxpaged.serve", "--port", str(port), "--log-level", "warning",
               *SCHEDULER_LIMITS, *JAXPAGED_SYSTEMS[system]]
        model = None
    elif system == "vllm":
        from benchmarks.peers import vllm_peer

        # The same scheduler limits as jaxpaged's; prefix caching is on in both by default. Its KV
        # pool is VLLM_CPU_KVCACHE_SPACE=2 GiB, far above what 12 requests of <= 200 tokens use.
        bind = {} if vllm_threads_bind == "auto" else {"VLLM_CPU_OMP_THREADS_BIND": vllm_threads_bind}
        return vllm_peer.start_server(port, log_path, (*SCHEDULER_LIMITS, "--seed", "0"), peers_dir, bind)
    else:
        # The same KV budget and token budget as jaxpaged's (513 pages of 16 tokens, 256 tokens per step):
        # left to its defaults, its CPU KV cache took 13 GB here and the OOM killer stopped it.
        cmd = [shutil.which("transformers") or "transformers", "serve", "--continuous-batching", "--device", "cpu",
               "--cb-block-size", "16", "--cb-num-blocks", "513", "--cb-max-batch-tokens", "256",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", hf_dir]
        model = hf_dir
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), model


def wait_ready(base: str, proc: subprocess.Popen, model: str | None, timeout_s: float) -> float:
    """Waits for /health and then one completed warm-up chat request; returns the seconds it took."""
    t0 = time.perf_counter()
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0.0,
            **({"model": model} if model else {})}
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout_s).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s} s")


def busy_fraction(seconds: float) -> float:
    """The share of the machine's CPU time that was not idle over the next `seconds` (/proc/stat)."""
    def times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait

    (total0, idle0), _ = times(), time.sleep(seconds)
    total1, idle1 = times()
    return round(1.0 - (idle1 - idle0) / max(1, total1 - total0), 3)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None and os.getpgid(proc.pid) == proc.pid:  # vLLM's: a process group of its own
        from benchmarks.peers import vllm_peer

        vllm_peer.stop_server(proc)  # the API server and its engine core process together
        return
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
