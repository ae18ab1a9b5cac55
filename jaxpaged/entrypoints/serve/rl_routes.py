"""vLLM's RL control endpoints, served when VLLM_SERVER_DEV_MODE=1 (vLLM's gate for them):

    POST /pause?mode=abort|wait|keep&clear_cache=true   no step until /resume (rl_control.py's modes);
                                                         requests that arrive meanwhile wait, unadded
    POST /resume                                         held requests are added, stepping resumes
    GET  /is_paused                                      {"is_paused": bool}
    POST /abort_requests {"request_ids": [...]}          those requests finish now with finish_reason
                                                         "abort", no pause; {} or [] aborts every one.
                                                         Ids are vLLM's external ids (bridge.py):
                                                         "chatcmpl-<id>", "cmpl-<id>-<prompt>", or
                                                         "cmpl-<id>" for all of a response's prompts;
                                                         unknown ids are ignored. {"status": "aborted",
                                                         "aborted": how many ids were sent (vLLM's
                                                         count), or how many requests for {}}
    POST /update_weight_version {"new_version": "..."}   relabels the current weights
    GET  /weight_info                                    {"weight_version": "..."}
    POST /init_weight_transfer_engine {"init_info": {"trainer_address": "host:port"}}
    POST /start_weight_update
    POST /update_weights {"update_info": {"uuid", "names", "dtype_names", "shapes", "kind"}}
    POST /finish_weight_update {"weight_version": "..."}
                                                         vLLM's weight sync from a trainer process,
                                                         backend "jax_transfer" (entrypoints/
                                                         weight_transfer.py): each update's arrays are
                                                         pulled on a worker thread while the engine
                                                         steps; finish applies them between two steps,
                                                         requests in flight kept

Each runs on the engine thread between two steps (`EngineBridge.run_on_engine`), so the engine keeps
its one caller. Every completion and chat response also carries the `weight_version` its last token
was sampled under.
"""

from __future__ import annotations

import asyncio
import os
import threading

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from jaxpaged.entrypoints.rl_control import StagedWeights, check_pause_mode
from jaxpaged.entrypoints.serve.common import APIError, server_state
from jaxpaged.entrypoints.weight_transfer import TransferReceiver, params_from_leaves, staged_chunk
from jaxpaged.models.hf_weights import params_from_weights

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

router = APIRouter()


def enabled() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip() == "1"


async def _on_engine(request: Request, fn):
    return await asyncio.wrap_future(server_state(request).bridge.run_on_engine(fn))


def _pause(bridge, mode: str, clear_cache: bool) -> None:
    bridge.paused = True
    if mode == "keep":
        return
    if mode == "abort":
        bridge.engine.abort_all_requests()  # final outputs: the steps below deliver them
    bridge.step_until_idle()
    if clear_cache:
        bridge.engine.reset_prefix_cache()


def _resume(bridge) -> None:
    bridge.paused = False
    bridge.add_held()


@router.post("/pause")
async def pause(request: Request, mode: str = "abort", clear_cache: bool = True):
    try:
        check_pause_mode(mode)
    except ValueError as err:
        raise APIError(400, str(err), param="mode") from None
    await _on_engine(request, lambda bridge: _pause(bridge, mode, clear_cache))
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request):
    await _on_engine(request, _resume)
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request):
    return {"is_paused": await _on_engine(request, lambda bridge: bridge.paused)}


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_ids: list[str] | str | None = None  # one id or a list, as vLLM's engine.abort takes


@router.post("/abort_requests")
async def abort_requests(body: AbortRequests, request: Request):
    request_ids = [body.request_ids] if isinstance(body.request_ids, str) else body.request_ids
    if request_ids:
        await _on_engine(request, lambda bridge: bridge.abort_external(request_ids))
        return {"status": "aborted", "aborted": len(request_ids)}
    count = await _on_engine(request, lambda bridge: bridge.engine.abort_all_requests())
    return {"status": "aborted", "aborted": count}


class NewVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    new_version: str


@router.post("/update_weight_version")
async def update_weight_version(body: NewVersion, request: Request):
    await _on_engine(request, lambda bridge: bridge.engine.set_weight_version(body.new_version))
    return {"success": True, "new_version": body.new_version}


@router.get("/weight_info")
async def weight_info(request: Request):
    return {"weight_version": str(await _on_engine(request, lambda bridge: bridge.engine.weight_version))}


class WeightSync:
    """The server's weight-sync state (one trainer connection, one staged update), on app.state."""

    def __init__(self):
        self.receiver = TransferReceiver()
        self.staged = StagedWeights()
        self.lock = threading.Lock()  # handlers' worker threads: one pull or stage at a time


def _weight_sync(request: Request) -> WeightSync:
    return request.app.state.weight_sync


async def _in_thread(fn):
    """`fn()` on a worker thread (a pull blocks on the network); ValueError -> 400, RuntimeError -> 502."""
    try:
        return await asyncio.to_thread(fn)
    except ValueError as err:
        raise APIError(400, str(err)) from None
    except RuntimeError as err:
        raise APIError(502, str(err), "bad_gateway") from None


class InitWeightTransfer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    init_info: dict


class UpdateWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    update_info: dict


class FinishWeightUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_version: str | None = None


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(body: InitWeightTransfer, request: Request):
    sync = _weight_sync(request)

    def init():
        with sync.lock:
            sync.receiver.init({"init_info": body.init_info})
    await _in_thread(init)
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request):
    sync = _weight_sync(request)

    def start():
        with sync.lock:
            sync.staged.start()
    await _in_thread(start)
    return {"message": "Weight update started"}


@router.post("/update_weights")
async def update_weights(body: UpdateWeights, request: Request):
    sync = _weight_sync(request)

    def update():
        with sync.lock:
            if not sync.staged.active:
                raise ValueError("no weight update is started; POST /start_weight_update first")
            sync.staged.add(staged_chunk(*sync.receiver.pull(body.update_info)))
    await _in_thread(update)
    return {"message": "Weights updated"}


def _apply(bridge, kind: str, value, version: str | None) -> None:
    engine = bridge.engine
    if kind == "leaves":
        params = params_from_leaves(engine.params, value)
    else:  # "weights": Hugging Face names
        try:
            params = params_from_weights(engine.model_config, value)
        except ValueError as err:
            raise ValueError(f"{err} (send every weight between /start_weight_update and /finish_weight_update)") \
                from None
    engine.update_params(params, version=version, in_flight="keep")


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, body: FinishWeightUpdate | None = None):
    sync = _weight_sync(request)
    version = body.weight_version if body is not None else None

    def finish():
        with sync.lock:
            return sync.staged.finish()
    kind, value = await _in_thread(finish)
    try:
        await _on_engine(request, lambda bridge: _apply(bridge, kind, value, version))
    except ValueError as err:  # a wrong tree, shape or dtype: nothing changed, the engine serves on
        raise APIError(400, str(err)) from None
    return {"message": "Weight update finished"}


def response_fields(finals) -> dict:
    """With VLLM_SERVER_DEV_MODE=1: {"weight_version": the label its last token was sampled under}."""
    if not enabled():
        return {}
    versions = [v for final in finals for c in final.outputs for v in (c.weight_versions or [])[-1:]]
    return {"weight_version": str(versions[-1])} if versions else {}


def attach(app: FastAPI) -> None:
    """The routes above, when VLLM_SERVER_DEV_MODE=1 (as vLLM attaches its own)."""
    if enabled():
        app.state.weight_sync = WeightSync()
        app.include_router(router)
