"""The weight routes of TRL and of vLLM's weight-transfer API, over the weight relay
(transfer/relay.py): a trainer's unchanged client joins a group of two ranks with the relay, and
the relay hands each update to the whole fleet as push_weights does.

- TRL <= 1.10 (`trl vllm-serve`): POST /init_communicator/ {host, port, world_size},
  POST /update_named_param/ {name, dtype, shape} (answered at once; the tensor follows over the
  group), POST /close_communicator/. The update reaches the fleet once every tensor of the
  served checkpoint arrived, or at the next /reset_prefix_cache/ (TRL calls it after an update),
  which answers once every replica holds it.
- vLLM's weight-transfer API (what TRL >= 1.11 calls): POST /init_weight_transfer_engine
  {init_info}, /start_weight_update, /update_weights {update_info: {names, dtype_names, shapes,
  packed}}, /finish_weight_update (answers once every replica holds the new weights, with their
  version), /shutdown_weight_transfer_engine; GET /weight_info.
A refused field answers 422 naming it (FastAPI's form, as both servers answer); a fleet that
cannot load the update answers 409 with each replica's error (TRL retries a 500, and its retry
would find nothing left to commit); a step stuck past its bound (a trainer that died mid-broadcast)
answers 504 naming what it waited for, and the relay takes a new init (relay_runner.py).

Retries: TRL's client retries a POST whose answer was lost, with the same body, and the routes
are idempotent where it does (transfer/relay.py, "Retries", says how each is recognized). A
retried /init_communicator/ or /update_named_param/ is answered without queuing its step again;
/start_weight_update, /close_communicator/ and /shutdown_weight_transfer_engine repeat
harmlessly; a retried /init_weight_transfer_engine opens the group again, as a restarted
trainer's must.
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ...transfer.relay import RelayError, RelayTimeout, WeightRelay
from .context import ProtocolContext, ProtocolError
from .json_body import read_json
from .relay_runner import RelayRunner
from .trl import parse_model, refusal, unprocessable

log = logging.getLogger("ray.serve")
COMMIT_TIMEOUT_S = 600.0  # how long the relay's commit (a push to every replica) may take


class FleetClient:
    """What client/fleet_ops.push_weights asks of a client, over the Gateway's signed router
    handle. Called on the relay's thread, never on the event loop."""

    config = None  # the fleet's size comes from the router's status

    def __init__(self, router, call_timeout_s: float):
        self.router, self.call_timeout_s = router, call_timeout_s

    def status(self) -> dict:
        return self.router.status.remote().result(timeout_s=self.call_timeout_s)


def fleet_commit(router, call_timeout_s: float, timeout_s: float = COMMIT_TIMEOUT_S):
    """The relay's commit: push_weights of what it received to every replica (running sequences
    end first, as TRL's server updates between generate calls); returns the version."""
    from ...client import fleet_ops
    from ...transfer.buckets import DEFAULT_BUCKET_BYTES

    client = FleetClient(router, call_timeout_s)

    def commit(named_tensors: list) -> int:
        return fleet_ops.push_weights(client, named_tensors, None, DEFAULT_BUCKET_BYTES, timeout_s, "finish")

    return commit


def relay_runner(router, model_root: str, call_timeout_s: float) -> RelayRunner:
    from ...engines.weight_checks import served_weights
    from ...transfer.channels import relay_backend

    served = served_weights(model_root)  # with load_format dummy too: the config's names and shapes
    log.info("weight relay: a trainer's tensors are bounded by %s (%s names, cap %s bytes)", served.source,
             len(served.spec) if served.spec is not None else "any", served.max_bytes)
    return RelayRunner(WeightRelay(served.spec, fleet_commit(router, call_timeout_s), relay_backend(),
                                   max_bytes=served.max_bytes, commit_timeout_s=COMMIT_TIMEOUT_S))


class InitCommunicator(BaseModel):
    # TRL adds client_device_uuid, which the relay does not need; strict: "5000" or true is no port
    model_config = ConfigDict(extra="allow", strict=True)
    host: str
    port: int
    world_size: int


class NamedParam(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # a shape of [true, 3] is no shape
    name: str
    dtype: str
    shape: list[int]


def _refuse(e: Exception) -> JSONResponse:
    if isinstance(e, RelayTimeout):  # 504, which TRL's client does not retry: the group is gone, init again
        return JSONResponse({"detail": f"weight relay timed out: {e}"}, status_code=504)
    if isinstance(e, RelayError):
        return unprocessable(e.field, str(e))
    if isinstance(e, ProtocolError):
        return unprocessable(e.param or "body", e.message)
    # 409, not 500: TRL's client retries a 500, and a retried finish would find nothing staged and succeed
    return JSONResponse({"detail": f"weight update failed: {e}"}, status_code=409)


async def _body(ctx: ProtocolContext, request: Request, model: Optional[type] = None):
    body = await read_json(request, ctx.limits)
    return body if model is None else parse_model(model, body)


def _field(body, name: str):
    return body.get(name) if isinstance(body, dict) else body


def trl_weight_routes(ctx: ProtocolContext, runner: RelayRunner) -> APIRouter:
    api = APIRouter()
    relay = runner.relay

    async def step(message: str, method: str, request: Optional[Request] = None, field: Optional[str] = None):
        """One relay step the client waits for: its body's `field` (if any) to `method`."""
        try:
            args = (_field(await _body(ctx, request), field),) if request is not None else ()
            result = await runner.call(method, *args)
            return {"message": message} if result is None else {"message": message, "version": result}
        except Exception as e:
            return _refuse(e)

    @api.post("/init_communicator/", summary="TRL <= 1.10: join the trainer's group (the relay is rank 0)")
    async def init_communicator(request: Request):
        try:
            req = await _body(ctx, request, InitCommunicator)
            relay.check_trl(req.host, req.port, req.world_size)
            if relay.announce("open_trl", req.host, req.port, req.world_size):  # else a retry, queued already
                runner.background("open_trl", req.host, req.port, req.world_size)  # the trainer joins after the answer
            return {"message": "Request received, initializing communicator"}
        except Exception as e:
            return _refuse(e)

    @api.post("/update_named_param/", summary="TRL <= 1.10: one tensor, which follows over the group")
    async def update_named_param(request: Request):
        try:
            req = await _body(ctx, request, NamedParam)
            # every check that needs no byte of the tensor, before the answer the trainer broadcasts after
            if relay.accept_param(req.name, req.dtype, req.shape, opening=runner.pending["open_trl"] > 0):
                runner.background("receive_param", req.name, req.dtype, req.shape)  # else a retry, queued already
            return {"message": "Request received, updating named parameter"}
        except Exception as e:
            return _refuse(e)

    @api.post("/close_communicator/", summary="TRL <= 1.10: what arrived goes to the fleet; leave the group")
    async def close_communicator():
        return await step("Request received, closing communicator", "close")

    @api.post("/init_weight_transfer_engine", summary="vLLM / TRL >= 1.11: join the trainer's group (rank 1)")
    async def init_weight_transfer_engine(request: Request):
        return await step("Weight transfer initialized", "open_vllm", request, "init_info")

    @api.post("/start_weight_update", summary="vLLM / TRL >= 1.11: an update begins")
    async def start_weight_update():
        return await step("Weight update started", "start")

    @api.post("/update_weights", summary="vLLM / TRL >= 1.11: the announced tensors, broadcast in packed chunks")
    async def update_weights(request: Request):
        return await step("Weights updated", "receive_packed", request, "update_info")

    @api.post("/finish_weight_update", summary="vLLM / TRL >= 1.11: every replica loads the update (its version)")
    async def finish_weight_update():
        return await step("Weight update finished", "finish")

    @api.post("/shutdown_weight_transfer_engine", summary="vLLM: leave the trainer's group")
    async def shutdown_weight_transfer_engine():
        return await step("Weight transfer shut down", "close")

    @api.get("/weight_info", summary="vLLM: the weights version the fleet serves")
    async def weight_info():
        try:
            st = await ctx.status()
        except ProtocolError as e:  # no router answers: 503
            return refusal(e)
        return {"weight_version": str(st["weights"]["version"]), "relay": relay.describe()}

    return api
