"""LoRA adapters on the server, vLLM's way:

    --enable-lora --lora-modules sql=/path/to/peft_dir poet=...   adapters served from the start
    "model": "sql" on /v1/completions and /v1/chat/completions     the request runs under adapter sql
    GET  /v1/models                                                the base model, then each adapter
                                                                   ("parent": the base model's name)
    POST /v1/load_lora_adapter   {"lora_name": ..., "lora_path": ...}   with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
    POST /v1/unload_lora_adapter {"lora_name": ...}                     (vLLM's flag; else no such routes)

Adapters get lora_int_ids 1, 2, ... in the order they are added. Loading runs on the engine thread
between two steps (`EngineBridge.run_on_engine`): a bad adapter is a 400 and nothing changes.
"""

from __future__ import annotations

import asyncio
import json
import os

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from jaxpaged.entrypoints.serve.common import APIError, server_state
from jaxpaged.planner.lora_request import LoRARequest

RUNTIME_UPDATE_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATE_ENV, "").strip().lower() in ("1", "true")


def parse_lora_modules(items: list[str]) -> list[LoRARequest]:
    """`--lora-modules` entries, `name=path` or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`,
    as LoRARequests with ids 1, 2, ...; ValueError naming a bad entry."""
    requests: list[LoRARequest] = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"--lora-modules {item!r}: expected name=path or a JSON object with 'name' and "
                                 f"'path' ({err})") from None
        else:
            name, sep, path = item.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path (a PEFT adapter directory)")
        if any(r.lora_name == name for r in requests):
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        requests.append(LoRARequest(name, len(requests) + 1, path, base_model_name=base))
    return requests


def model_cards(state, base_card: dict) -> list[dict]:
    """/v1/models' entries of the adapters (vLLM's fields: root is the adapter's path, parent the base model)."""
    return [dict(base_card, id=name, root=lora.lora_path, parent=state.served_model_name)
            for name, lora in state.loras.items()]


class LoadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRA, request: Request):
    state = server_state(request)
    if not state.config.enable_lora:
        raise APIError(400, "this server runs without LoRA; start it with --enable-lora", param="lora_name")
    if body.lora_name in state.loras or body.lora_name == state.served_model_name:
        raise APIError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded; unload it first",
                       param="lora_name")
    lora = LoRARequest(body.lora_name, max((r.lora_int_id for r in state.loras.values()), default=0) + 1,
                       body.lora_path)
    future = state.bridge.run_on_engine(lambda bridge: bridge.engine.add_lora(lora))
    try:
        await asyncio.wrap_future(future)
    except ValueError as err:  # a bad adapter: nothing changed
        raise APIError(400, str(err), param="lora_path") from None
    state.loras[body.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRA, request: Request):
    state = server_state(request)
    lora = state.loras.get(body.lora_name)
    if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", "not_found_error",
                       param="lora_name")
    future = state.bridge.run_on_engine(lambda bridge: bridge.engine.remove_lora(lora.lora_int_id))
    try:
        await asyncio.wrap_future(future)
    except ValueError as err:  # requests still run under it
        raise APIError(400, str(err), param="lora_name") from None
    del state.loras[body.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def attach(app: FastAPI) -> None:
    """The load / unload routes, when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (as vLLM attaches them)."""
    if runtime_updates_allowed():
        app.include_router(router)
