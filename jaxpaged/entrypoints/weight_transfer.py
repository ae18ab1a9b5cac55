"""Weights from a trainer in another process, without disk and without pickle: vLLM's weight-transfer
protocol (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`) over `jax.experimental.transfer`, backend "jax_transfer".

    trainer process                                   engine process (LLM, or the server's routes)
    TrainerWeightTransfer: a TransferServer
      init_info() ------------ JSON -----------------> init_weight_transfer_engine: a TransferServer of
                                                       its own, connected to the trainer's
      offer(arrays): await_pull(uuid, arrays)
      update_info ------------ JSON -----------------> update_weights: connection.pull(uuid, shapes)
                   <========= array bytes (TCP) ======   straight into arrays of those shapes and dtypes
                                                       finish_weight_update: staged -> update_params

The control plane is small JSON (vLLM's update_info fields: names, dtype_names, shapes, plus the
pull's uuid and the names' kind); the data plane is XLA's transfer library moving each buffer's
bytes. An `update_info` names its arrays either by Hugging Face names (kind "weights", vLLM's:
chunks merge until finish) or by jaxpaged parameter-tree paths (kind "params", `jax.tree_util.keystr`
of `llm.params`' leaves: what a JAX trainer holds; every leaf must arrive before finish).

The pull runs on the caller's thread (the server: a worker thread, not the engine's), so generation
goes on while bytes move; only `finish_weight_update` touches the engine, between two steps.
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

BACKEND = "jax_transfer"
KINDS = ("weights", "params")  # Hugging Face names | jaxpaged tree paths
DEFAULT_PULL_TIMEOUT_S = 300.0
_SETTLE_S = 10.0  # how long a poisoned pull may take to fail


def _transfer():
    from jax.experimental import transfer  # XLA's cross-process transfer library (jax >= 0.5)

    return transfer


def _host(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address {address!r}: pass 'host:port', e.g. '127.0.0.1:0' (port 0: any free port)")
    return host


def _start_server(address: str):
    _host(address)
    device = jax.local_devices()[0]
    return _transfer().start_transfer_server(device.client, address, [address])


def leaves_by_path(params) -> dict[str, jax.Array]:
    """{keystr(path): leaf} of a parameter tree: the names of kind "params"."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def params_from_leaves(like, leaves: Mapping[str, object]):
    """The tree of `like` (the engine's params) with every leaf taken from `leaves` by path;
    ValueError naming the first missing or unknown path."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    missing = [p for p in paths if p not in leaves]
    if missing:
        raise ValueError(f"a 'params' update needs every leaf of the engine's tree; missing {missing[0]} "
                         f"({len(missing)} of {len(paths)} missing)")
    unknown = sorted(set(leaves) - set(paths))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is no leaf of the engine's parameter tree (names: keystr of "
                         "jax.tree_util.tree_flatten_with_path(llm.params))")
    return jax.tree_util.tree_unflatten(treedef, [leaves[p] for p in paths])


def _check_update_info(info) -> tuple[int, str, list[str], list[jax.ShapeDtypeStruct]]:
    if not isinstance(info, Mapping):
        raise ValueError("update_info must be a mapping: {'uuid', 'names', 'dtype_names', 'shapes', 'kind'}")
    required = ("uuid", "names", "dtype_names", "shapes")
    absent = [k for k in required if k not in info]
    if absent:
        raise ValueError(f"update_info lacks {absent}; a {BACKEND} update carries uuid, names, dtype_names and "
                         "shapes (TrainerWeightTransfer.offer returns it)")
    uuid, names, dtype_names, shapes = (info[k] for k in required)
    kind = info.get("kind", "weights")
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: use 'weights' (Hugging Face names) or 'params' (jaxpaged tree paths)")
    if not isinstance(uuid, int) or isinstance(uuid, bool) or uuid < 0:
        raise ValueError(f"uuid={uuid!r} must be a non-negative int (the trainer's offer)")
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)) or not names \
            or not len(names) == len(dtype_names) == len(shapes):
        raise ValueError("names, dtype_names and shapes must be non-empty lists of the same length")
    if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError("names must be distinct strings")
    device = jax.local_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = []
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        try:
            dtype = jnp.dtype(dtype_name)
        except TypeError:
            raise ValueError(f"{name}: dtype {dtype_name!r} is not a dtype name (e.g. 'bfloat16', 'float32')") from None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{name}: shape {shape!r} must be a list of non-negative ints")
        specs.append(jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding))
    return uuid, kind, names, specs


class TransferReceiver:
    """The engine's side: one connection to one trainer (`init`), then a pull per `update_weights`."""

    def __init__(self):
        self.server = None
        self.connection = None
        self.trainer_address: str | None = None
        self.timeout_s = DEFAULT_PULL_TIMEOUT_S
        self.num_bytes_pulled = 0

    def init(self, request) -> None:
        """vLLM's init_weight_transfer_engine: `{"init_info": {"trainer_address": "host:port",
        "backend": "jax_transfer" (optional), "timeout_s": seconds a pull may wait (optional)}}`."""
        info = request.get("init_info") if isinstance(request, Mapping) else getattr(request, "init_info", None)
        if not isinstance(info, Mapping) or not isinstance(info.get("trainer_address"), str):
            raise ValueError("init_weight_transfer_engine takes {'init_info': {'trainer_address': 'host:port'}} "
                             "(TrainerWeightTransfer.init_info() in the trainer's process)")
        backend = info.get("backend", BACKEND)
        if backend != BACKEND:
            raise ValueError(f"weight transfer backend {backend!r} is not supported; jaxpaged has {BACKEND!r} "
                             "(vLLM's 'nccl' and 'ipc' move torch CUDA tensors)")
        timeout_s = info.get("timeout_s", DEFAULT_PULL_TIMEOUT_S)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        address = info["trainer_address"]
        host = _host(address)
        if self.server is None:
            self.server = _start_server(f"{host}:0")
        self.connection = self.server.connect(address)
        self.trainer_address, self.timeout_s = address, float(timeout_s)

    def _poison(self) -> None:
        """Fails the pulls still pending on the connection (jaxlib's `_poison_connection`, where it
        exists), so their buffers are freed and nothing waits on them when the process exits."""
        poison = getattr(self.connection, "_poison_connection", None)
        if poison is not None:
            poison()

    def pull(self, info) -> tuple[str, dict[str, jax.Array]]:
        """(kind, {name: array}) of one offer; blocks until the bytes are here (or timeout_s)."""
        uuid, kind, names, specs = _check_update_info(info)
        if self.connection is None:
            raise ValueError("no weight transfer is initialised; call init_weight_transfer_engine("
                             "{'init_info': {'trainer_address': ...}}) first")
        arrays = self.connection.pull(uuid, specs)  # returns at once; the bytes land later
        error = _wait_ready(arrays, self.timeout_s, on_timeout=self._poison)
        if error is not None:  # the trainer is gone, never offered this uuid, or offered other shapes
            self.connection = self.server.connect(self.trainer_address)
            raise RuntimeError(f"pulling update {uuid} from {self.trainer_address} failed: {error}; check the trainer "
                               "offered it (TrainerWeightTransfer.offer: these names, shapes and dtypes) and is "
                               "still running")
        self.num_bytes_pulled += sum(a.nbytes for a in arrays)
        return kind, dict(zip(names, arrays))


def _wait_ready(arrays, timeout_s: float, on_timeout) -> str | None:
    """None once every array's bytes are here; else what went wrong (an error, or the timeout). The
    library's own pull timeout does not fail a pull of a uuid nobody offers (jax 0.10), so the wait
    runs on a helper thread with this deadline; past it `on_timeout()` must fail the pull, and the
    helper is waited for (a thread left blocked in the runtime aborts the process at exit)."""
    done, result = threading.Event(), []

    def wait():
        try:
            jax.block_until_ready(arrays)
        except Exception as err:  # noqa: BLE001 - reported to the caller
            result.append(f"{type(err).__name__}: {err}")
        done.set()

    threading.Thread(target=wait, name="jaxpaged-weight-pull", daemon=True).start()
    if not done.wait(timeout_s):
        on_timeout()
        done.wait(_SETTLE_S)
        return f"no bytes within timeout_s={timeout_s:g} s"
    return result[0] if result else None


def staged_chunk(kind: str, arrays: dict) -> dict:
    """What `StagedWeights.add` takes for pulled arrays."""
    return {"update_info": {"weights" if kind == "weights" else "leaves": arrays}}


def is_transfer_info(info) -> bool:
    return isinstance(info, Mapping) and "uuid" in info


class TrainerWeightTransfer:
    """The trainer's side: a TransferServer that offers arrays for the engine to pull.

        sender = TrainerWeightTransfer("127.0.0.1:0")
        client.init_weight_transfer_engine({"init_info": sender.init_info()})
        sender.send_weights(client, {hf_name: array} or leaves_by_path(params), kind=..., weight_version=...)

    `client` is an `LLM` in this process or `HTTPWeightSyncClient(url)` for a server (vLLM's names on both).
    """

    def __init__(self, address: str = "127.0.0.1:0"):
        self.server = _start_server(address)
        self._next_uuid = secrets.randbits(40)  # distinct from another trainer's on the same engine
        self.num_bytes_offered = 0

    @property
    def address(self) -> str:
        return self.server.address()

    def init_info(self) -> dict:
        return {"backend": BACKEND, "trainer_address": self.address}

    def offer(self, arrays: Mapping[str, object], *, kind: str = "weights") -> dict:
        """Makes `arrays` ({name: array}) pullable once; returns the update_info that names them."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: use 'weights' (Hugging Face names) or 'params' (jaxpaged tree paths)")
        if not arrays:
            raise ValueError("offer() needs at least one array")
        names = list(arrays)
        values = [jnp.asarray(arrays[n]) for n in names]
        uuid, self._next_uuid = self._next_uuid, self._next_uuid + 1
        self.server.await_pull(uuid, values)
        self.num_bytes_offered += sum(v.nbytes for v in values)
        return {"uuid": uuid, "kind": kind, "names": names, "dtype_names": [str(v.dtype) for v in values],
                "shapes": [list(v.shape) for v in values]}

    def send_weights(self, client, arrays: Mapping[str, object], *, kind: str = "weights",
                     weight_version: str | None = None, chunk_bytes: int | None = None) -> None:
        """One whole update through `client`: start, an update per chunk of about `chunk_bytes`
        (None: one), finish. Returns once the engine has applied it."""
        chunks, chunk, size = [], {}, 0
        for name, array in arrays.items():
            chunk[name] = array
            size += np.dtype(array.dtype).itemsize * int(np.prod(array.shape))
            if chunk_bytes is not None and size >= chunk_bytes:
                chunks.append(chunk)
                chunk, size = {}, 0
        if chunk:
            chunks.append(chunk)
        client.start_weight_update()
        for chunk in chunks:
            client.update_weights({"update_info": self.offer(chunk, kind=kind)})
        client.finish_weight_update(weight_version)


class HTTPWeightSyncClient:
    """vLLM's weight-sync routes of a server started with VLLM_SERVER_DEV_MODE=1, called as `LLM`'s methods."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def _post(self, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"{path}: HTTP {err.code}: {err.read().decode(errors='replace')}") from None

    def init_weight_transfer_engine(self, request: dict) -> dict:
        return self._post("/init_weight_transfer_engine", dict(request))

    def start_weight_update(self) -> dict:
        return self._post("/start_weight_update")

    def update_weights(self, request: dict) -> dict:
        return self._post("/update_weights", dict(request))

    def finish_weight_update(self, weight_version: str | None = None) -> dict:
        return self._post("/finish_weight_update", {"weight_version": weight_version})
