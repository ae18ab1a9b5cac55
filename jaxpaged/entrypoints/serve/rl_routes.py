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

Each runs on the engine thread between two steps (`EngineBridge.run_on_engine`), so the engine keeps
its one caller. Every completion and chat response also carries the `weight_version` its last token
was sampled under.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from jaxpaged.entrypoints.rl_control import check_pause_mode
from jaxpaged.entrypoints.serve.common import APIError, server_state

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


def response_fields(finals) -> dict:
    """With VLLM_SERVER_DEV_MODE=1: {"weight_version": the label its last token was sampled under}."""
    if not enabled():
        return {}
    versions = [v for final in finals for c in final.outputs for v in (c.weight_versions or [])[-1:]]
    return {"weight_version": str(versions[-1])} if versions else {}


def attach(app: FastAPI) -> None:
    """The routes above, when VLLM_SERVER_DEV_MODE=1 (as vLLM attaches its own)."""
    if enabled():
        app.include_router(router)
