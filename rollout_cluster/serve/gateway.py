"""The HTTP face of the app: a FastAPI app served through `serve.ingress`, under the route prefix
/<app_name>. Every route but /healthz asks for `Authorization: Bearer <token>` (security.token_file;
401 without it), and every body is bounded by the config's `limits` (docs/security.md).

- GET  /<app>/healthz   "ok", without a token (liveness probes); it says nothing else;
- GET  /<app>           the router's status as JSON (dashboards); 503 with Retry-After while no
  router answers (down or restarting; router_reach.py), as every route that asks it answers;
- POST /<app>/generate  a batch in the JSONL format of `rollout-cluster generate` (client/jsonl.py,
  one request a line), answered with the output JSONL once every sequence is done. `?timeout_s=`
  bounds the wait (default 3600, or limits.max_timeout_s if less); past it the batch is cancelled
  and the answer is 504.
  `?weights_version=` runs it only on those weights: a fleet on others answers 409.
  `?finish_fraction=` (and `&finish_by=group`) cuts it there: partial rollouts (resume.py). A bad
  query parameter answers 400 naming it; no live replica or a lost batch, 503; a body past
  limits.max_body_bytes or limits.max_lines, or more sequences than limits.max_batch_sequences,
  413; a router that holds limits.max_live_sequences already, 429 with Retry-After;
- GET  /<app>/docs, /<app>/openapi.json  FastAPI's pages of the above.
For trainers that are not Python; a Python driver uses RolloutClient (streaming, no HTTP limits).
The batch is followed as RolloutClient.stream follows it (client/loops.py), so a router restart
resubmits what was not received; the Gateway is a deployment of its own that outlives the router.
"""
from __future__ import annotations

import logging

import os

import base64
import hashlib
import hmac
import json
import math
from typing import Optional

from fastapi import FastAPI, Query, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException

from ..client.follower import check_finish_fraction
from ..client.jsonl import merge_results, read_requests, split_lines
from ..niceness import set_niceness
from ..parsing import shown
from ..config import LimitsConfig, load_config
from ..protocol import InputError, LimitExceeded, RouterBusy, WeightsVersionError
from ..security.secrets import read_keys, read_token
from ..security.signed_router import SignedRouter
from ..security.signing import Signer
from .app_name import serve_app_name
from ..text.codec import TextCodec
from .call_timeline import TRACE_HEADER, CallTimeline, TimedRouter, current_label
from .http_body import read_bounded
from ..client.loops import follow_batch
from .protocols.context import ProtocolContext
from .protocols.openai import openai_routes
from .protocols.trl import trl_routes
from .protocols.trl_weights import relay_runner, trl_weight_routes
from .router_reach import RouterAbsent, router_status

# What a query parameter that does not parse must be (400, naming it and the value)
MUST_BE = {"timeout_s": "not a number", "weights_version": "must be an integer >= 0",
           "finish_fraction": "must be a number in (0, 1]"}
NDJSON = "application/x-ndjson"
JSONL_BODY = {"requestBody": {"required": True, "content": {NDJSON: {"schema": {
    "type": "string", "description": "one request a line: {\"prompt_token_ids\": [..], \"n\": 1, \"max_tokens\": 128, "
                                     "...} (client/jsonl.py)"}}}}}


# The routes without a token: liveness only. TRL's client polls /health (/health/ before 1.11)
# with a bare request that carries no credentials, and waits for ever on a 401.
OPEN_PATHS = {"/healthz", "/health", "/health/"}

log = logging.getLogger("ray.serve")


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def gateway_app(router, sampling_defaults: Optional[dict] = None, call_timeout_s: float = 120.0,
                token: Optional[str] = None, limits: Optional[LimitsConfig] = None,
                protocols: Optional[ProtocolContext] = None, relay=None,
                timeline: Optional[CallTimeline] = None) -> FastAPI:
    """The routes over `router` (the Router's Serve handle, or anything with its methods).
    `sampling_defaults`: the config's `sampling`, what a line leaves out. `token`: what every
    route but /healthz asks for (None: no token; the Gateway deployment refuses that unless the
    config allows it). `limits`: the config's. `protocols`: with it, the OpenAI-compatible and
    TRL routes too (protocols/); `relay` (trl_weights.RelayRunner): with it, the weight routes.
    `timeline`: each request's arrival and answer are recorded there (call_timeline.py; the
    router handed in records its own calls)."""
    defaults = sampling_defaults or {}
    limits = limits or LimitsConfig()
    default_timeout_s = min(3600.0, limits.max_timeout_s)  # a batch that names none: an hour, within the limit
    if protocols is not None:
        protocols.batch_timeout_s = min(protocols.batch_timeout_s, limits.max_timeout_s)
    want = _digest(token) if token is not None else None
    app = FastAPI(title="rollout_cluster", description=__doc__)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if timeline is not None:
            return await timed(request, call_next)
        return await checked(request, call_next)

    async def timed(request: Request, call_next):
        current_label.set(request.headers.get(TRACE_HEADER, ""))
        timeline.record("received", path=request.url.path)
        response = await checked(request, call_next)
        timeline.record("answered", status=response.status_code)
        return response

    async def checked(request: Request, call_next):
        path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if want is None or (path or "/") in OPEN_PATHS:
            return await call_next(request)
        # digests of equal length, compared in constant time: neither the token nor its length leaks
        if not hmac.compare_digest(_digest(presented(request.headers.get("authorization", ""))), want):
            return JSONResponse({"error": "missing or wrong bearer token (Authorization: Bearer <token>; "
                                          "security.token_file)"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.get("/healthz", summary="liveness: 'ok', without a token")
    async def healthz():
        return Response("ok", media_type="text/plain")

    if protocols is not None:
        app.include_router(openai_routes(protocols))
        app.include_router(trl_routes(protocols, relay))
        if relay is not None:
            app.include_router(trl_weight_routes(protocols, relay))

    @app.get("/", summary="the router's status")
    async def status():
        try:
            st = await router_status(router, call_timeout_s)
        except RouterAbsent as e:  # down or restarting: later, as a full router's answer says
            return _error(str(e), 503, {"Retry-After": str(limits.retry_after_s)})
        return JSONResponse(json.loads(json.dumps(st, default=str)))

    @app.post("/generate", summary="a JSONL batch in, the output JSONL out", response_class=Response,
              responses={200: {"content": {NDJSON: {}}}}, openapi_extra=JSONL_BODY)
    async def generate(request: Request, timeout_s: Optional[float] = None,
                       weights_version: Optional[int] = Query(None, ge=0),
                       finish_fraction: Optional[float] = None, finish_by: str = "sample"):
        try:
            check_finish_fraction(finish_fraction, finish_by)
        except InputError as e:
            return _error(str(e), 400)
        if timeout_s is None:
            timeout_s = default_timeout_s
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= limits.max_timeout_s):
            return _error(f"timeout_s={timeout_s!r}: must be a number in (0, {limits.max_timeout_s:g}] "
                          f"(limits.max_timeout_s)", 400)
        body = await read_bounded(request, limits.max_body_bytes)
        if body is None:
            return _error(f"the body is larger than limits.max_body_bytes={limits.max_body_bytes}: split the batch", 413)
        lines = split_lines(body.decode("utf-8", errors="replace"))
        del body
        try:
            requests, errors = read_requests(lines, defaults, limits)
        except LimitExceeded as e:
            return _error(str(e), 413)
        results = [None] * len(requests)
        if requests:
            try:
                async for c in follow_batch(router, requests, timeout_s, call_timeout_s,
                                            weights_version=weights_version, finish_fraction=finish_fraction,
                                            finish_by=finish_by):
                    results[c.index] = c
            except WeightsVersionError as e:  # the fleet runs other weights than the caller trains
                return _error(str(e), 409)
            except RouterBusy as e:  # the router is full: later
                return _error(str(e), 429, {"Retry-After": str(limits.retry_after_s)})
            except LimitExceeded as e:  # the batch is too large: split it
                return _error(str(e), 413)
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
        return _error(f"{name}={shown(first.get('input'))}: {MUST_BE.get(name, first['msg'])}", 400)

    @app.exception_handler(HTTPException)
    async def wrong_method(request: Request, exc: HTTPException):
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        return _error(f"{request.method} {request.url.path}: use GET / for status, POST /generate for a batch", 405)

    return app


def presented(header: str) -> str:
    """The token an Authorization header presents: `Bearer <token>`, or HTTP Basic auth whose
    password is the token (what a client sends for `http://user:<token>@host/...`, or from
    ~/.netrc: TRL's client has no other way to send one)."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return ""
    return ""


def http_token(security) -> Optional[str]:
    """The token the routes ask for; RuntimeError when none is configured and the config does not
    say security.allow_unauthenticated (None then)."""
    token = read_token(security)
    if token is None and not security.allow_unauthenticated:
        raise RuntimeError("no HTTP token configured (security.token_file, or $ROLLOUT_TOKEN / $ROLLOUT_TOKEN_FILE): "
                           "set one, or security.allow_unauthenticated: true to serve HTTP to anyone")
    return token


def _error(message: str, status_code: int, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status_code, headers=headers)


def renice_serve_proxies(target) -> str | None:
    """Give Ray Serve's HTTP proxy on this node (the `ProxyActor` process) niceness `target`."""
    if target is None:
        return None
    try:
        import psutil

        for proc in psutil.process_iter(["cmdline"]):
            if any("ProxyActor" in part for part in (proc.info["cmdline"] or [])):
                for thread in proc.threads():
                    os.setpriority(os.PRIO_PROCESS, thread.id, target)
    except Exception as e:  # best effort: without it the proxy answers later on a busy node
        return f"could not renice Serve's proxy to {target}: {e}"
    return None


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    """The app's ingress: holds the Router and the EngineReplicas, so one application builds the
    whole graph, and serves gateway_app over the router (built on the replica, where the handle lives)."""

    def __init__(self, router, replicas, config: dict):
        cfg = load_config(config)
        sec = cfg.security
        self.token = http_token(sec)
        # the Gateway cancels the batches it runs (a timeout, a cut): signed as a driver's cancel is
        self.router = SignedRouter(router, Signer(read_keys(sec), app=serve_app_name() or ""))
        self.replicas = replicas
        self.cfg = cfg
        # The HTTP path's processes run at the router's niceness: at Ray's 15 they answer late
        # whenever the engines keep every core busy.
        for warning in (set_niceness(cfg.router.niceness, "router.niceness", all_threads=True),
                        renice_serve_proxies(cfg.router.niceness)):
            if warning:
                log.warning("gateway: %s", warning)

    def __serve_build_asgi_app__(self) -> FastAPI:
        cfg = self.cfg
        timeline = CallTimeline.from_env()
        router = self.router if timeline is None else TimedRouter(self.router, timeline)
        protocols = ProtocolContext(router, TextCodec.load(cfg.model_path()), cfg.limits, cfg.router.call_timeout_s,
                                    model_name=cfg.engine.model, model_root=cfg.model_path(),
                                    world_size=cfg.engine.tensor_parallel_size, logprobs_mode=cfg.engine.logprobs_mode,
                                    config_max_model_len=cfg.engine.max_model_len)
        relay = (relay_runner(self.router, cfg.model_path(), cfg.router.call_timeout_s)
                 if cfg.security.http_weight_updates else None)
        return gateway_app(router, cfg.sampling.spec_fields(), cfg.router.call_timeout_s, self.token, cfg.limits,
                           protocols, relay, timeline)
