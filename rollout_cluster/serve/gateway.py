"""The HTTP face of the app: a FastAPI app served through `serve.ingress`, under the route prefix
/<app_name>.

- GET  /<app>           the router's status as JSON (health checks, dashboards);
- POST /<app>/generate  a batch in the JSONL format of `rollout-cluster generate` (client/jsonl.py,
  one request a line), answered with the output JSONL once every sequence is done. `?timeout_s=`
  bounds the wait (default 3600); past it the batch is cancelled and the answer is 504.
  `?weights_version=` runs it only on those weights: a fleet on others answers 409.
  `?finish_fraction=` (and `&finish_by=group`) cuts it there: partial rollouts (resume.py). A bad
  query parameter answers 400 naming it; no live replica or a lost batch, 503;
- GET  /<app>/docs, /<app>/openapi.json  FastAPI's pages of the above.
For trainers that are not Python; a Python driver uses RolloutClient (streaming, no HTTP limits).
The batch is followed as RolloutClient.stream follows it (client/loops.py), so a router restart
resubmits what was not received; the Gateway is a deployment of its own that outlives the router.
"""
from __future__ import annotations

import json
from typing import Optional

from fastapi import FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException

from ..client.follower import check_finish_fraction
from ..client.jsonl import merge_results, read_requests
from ..client.loops import follow_batch
from ..protocol import InputError, WeightsVersionError

# What a query parameter that does not parse must be (400, naming it and the value)
MUST_BE = {"timeout_s": "not a number", "weights_version": "must be an integer >= 0",
           "finish_fraction": "must be a number in (0, 1]"}
NDJSON = "application/x-ndjson"
JSONL_BODY = {"requestBody": {"required": True, "content": {NDJSON: {"schema": {
    "type": "string", "description": "one request a line: {\"prompt_token_ids\": [..], \"n\": 1, \"max_tokens\": 128, "
                                     "...} (client/jsonl.py)"}}}}}


def gateway_app(router, sampling_defaults: Optional[dict] = None, call_timeout_s: float = 120.0) -> FastAPI:
    """The routes over `router` (the Router's Serve handle, or anything with its methods).
    `sampling_defaults`: the config's `sampling`, what a line leaves out."""
    defaults = sampling_defaults or {}
    app = FastAPI(title="rollout_cluster", description=__doc__)

    @app.get("/", summary="the router's status")
    async def status():
        return JSONResponse(json.loads(json.dumps(await router.status.remote(), default=str)))

    @app.post("/generate", summary="a JSONL batch in, the output JSONL out", response_class=Response,
              responses={200: {"content": {NDJSON: {}}}}, openapi_extra=JSONL_BODY)
    async def generate(request: Request, timeout_s: float = 3600.0,
                       weights_version: Optional[int] = Query(None, ge=0),
                       finish_fraction: Optional[float] = None, finish_by: str = "sample"):
        try:
            check_finish_fraction(finish_fraction, finish_by)
        except InputError as e:
            return _error(str(e), 400)
        lines = (await request.body()).decode("utf-8", errors="replace").splitlines()
        requests, errors = read_requests(lines, defaults)
        results = [None] * len(requests)
        if requests:
            try:
                async for c in follow_batch(router, requests, timeout_s, call_timeout_s, weights_version=weights_version,
                                            finish_fraction=finish_fraction, finish_by=finish_by):
                    results[c.index] = c
            except WeightsVersionError as e:  # the fleet runs other weights than the caller trains
                return _error(str(e), 409)
            except TimeoutError as e:
                return _error(str(e), 504)
            except Exception as e:  # no live replica, weights not loadable, batch lost: say why
                return _error(str(e), 503)
        records = merge_results(len(lines), requests, results, errors)
        return Response("".join(json.dumps(r) + "\n" for r in records), media_type=NDJSON)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        name = first["loc"][-1]
        return _error(f"{name}={first.get('input')!r}: {MUST_BE.get(name, first['msg'])}", 400)

    @app.exception_handler(HTTPException)
    async def wrong_method(request: Request, exc: HTTPException):
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        return _error(f"{request.method} {request.url.path}: use GET / for status, POST /generate for a batch", 405)

    return app


def _error(message: str, status_code: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status_code)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    """The app's ingress: holds the Router and the EngineReplicas, so one application builds the
    whole graph, and serves gateway_app over the router (built on the replica, where the handle lives)."""

    def __init__(self, router, replicas, sampling_defaults: Optional[dict] = None, call_timeout_s: float = 120.0):
        self.router = router
        self.replicas = replicas
        self.sampling_defaults = sampling_defaults or {}
        self.call_timeout_s = call_timeout_s

    def __serve_build_asgi_app__(self) -> FastAPI:
        return gateway_app(self.router, self.sampling_defaults, self.call_timeout_s)
