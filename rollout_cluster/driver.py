"""RolloutClient: the driver API. Submit a batch, get every completion back.

    client = RolloutClient.start("configs/local-cpu.yaml")   # local Ray + the Serve app
    client = RolloutClient.connect(app_name="rollout")          # an app that already runs
    results = client.generate(prompts, SamplingSpec(n=4, max_tokens=256))
    async for c in client.stream(prompts, sampling): ...

Every call is bounded: a router that does not answer within `timeout_s` raises TimeoutError.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterator, Optional, Sequence, Union

from .batch_follow import BatchAcrossRestarts
from .config import ClusterConfig, load_config
from .protocol import (BatchLostError, Completion, InputError, Partial, SamplingSpec, SequenceRequest, WeightsVersionError,
                    is_int)

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 3600.0
REPLICA_DEPLOYMENT = "EngineReplica"  # the engines' Serve deployment (serve/app.py)


def expand(prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec]],
           hidden_lengths: Optional[Sequence] = None) -> list:
    """One SequenceRequest per (prompt, sample), in input order. A prompt whose spec is invalid
    (n < 1, say) yields one request carrying the error, so it comes back as an error line. A
    `Partial` among the prompts is one sample, whatever its spec's n: it continues after its tokens."""
    specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
    if len(specs) != len(prompts):
        raise InputError("sampling", f"<{len(specs)} specs>", f"needs one spec per prompt ({len(prompts)})")
    out = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        if isinstance(prompt, Partial):
            hidden = None if hidden_lengths is None else hidden_lengths[len(out)]
            out.append(_resumed_request(prompt, spec, i, hidden))
            continue
        n = spec.n if isinstance(spec.n, int) and spec.n >= 1 else 1
        for j in range(n):
            hidden = None if hidden_lengths is None else hidden_lengths[len(out)]
            ids = list(prompt) if isinstance(prompt, (list, tuple)) else prompt
            out.append(SequenceRequest(ids if isinstance(ids, list) else [], spec, i, j, hidden,
                                       prompt_len=len(ids) if isinstance(ids, list) else 0))
            if not isinstance(ids, list):
                out[-1].prompt_token_ids = ids  # the router refuses it, naming the field
    return out


def _resumed_request(p: Partial, spec: SamplingSpec, index: int, hidden: Optional[int]) -> SequenceRequest:
    """A Partial's one request: a sample cut off before its first token starts afresh."""
    ids = list(p.prompt_token_ids) if isinstance(p.prompt_token_ids, (list, tuple)) else p.prompt_token_ids
    tokens = list(p.token_ids) if isinstance(p.token_ids, (list, tuple)) else p.token_ids
    logprobs = list(p.logprobs) if isinstance(p.logprobs, (list, tuple)) else p.logprobs
    if tokens == []:
        tokens = logprobs = None
    return SequenceRequest(ids, spec, index, 0, hidden, prompt_len=len(ids) if isinstance(ids, list) else 0,
                           output_token_ids=tokens, output_logprobs=logprobs)


def deploy(app, cfg: ClusterConfig, timeout_s: float) -> None:
    """serve.run without its unbounded wait: deploy the application, then wait at most timeout_s
    for Serve to call it RUNNING (every replica constructed: engines loaded). A replica that no
    node can host (more GPUs than any node has, say) would leave serve.run waiting forever;
    here it raises TimeoutError, and a constructor that keeps failing raises RuntimeError, each
    naming what Serve reports and what a replica asks for. The application is then removed."""
    from ray import serve
    from ray.serve.api import _run
    from ray.serve.schema import ApplicationStatus

    from .serve.app import replica_options

    name = cfg.app_name
    # external_scaler_enabled: RolloutClient.scale sets the fleet's size in place (Serve's
    # external scaling API); without it Serve refuses that call.
    _run(app, _blocking=False, name=name, route_prefix=f"/{name}", external_scaler_enabled=True)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(name)
        state = status.status if status else None
        if state == ApplicationStatus.RUNNING:
            return
        failed = state == ApplicationStatus.DEPLOY_FAILED
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    reports = [f"{d}: {getattr(ds.status, 'value', ds.status)} {ds.message}".strip()
               for d, ds in (status.deployments.items() if status else ()) if ds.status != "HEALTHY" or ds.message]
    asks = replica_options(cfg)["ray_actor_options"]
    serve.delete(name)
    what = "failed to deploy" if failed else f"was not running after {timeout_s:.0f} s (wait_ready_s)"
    detail = "; ".join(reports) or (status.message if status else "no status")
    error = RuntimeError if failed else TimeoutError
    raise error(f"Serve application {name!r} {what}, and was removed. Each EngineReplica asks for "
                f"num_cpus={asks['num_cpus']:g} num_gpus={asks['num_gpus']:g} (resources.*, "
                f"engine.tensor_parallel_size; a replica's GPUs must be on one node). Serve says: {detail}")


def check_replicas(replicas) -> None:
    """RolloutClient.scale's size: an integer >= 1."""
    if not is_int(replicas) or replicas < 1:
        raise InputError("replicas", replicas, "must be an integer >= 1")


def _one_line(message: str) -> str:
    return " ".join((message or "").split()) or "no message"


class RolloutClient:
    def __init__(self, app_name: str = "rollout", timeout_s: float = DEFAULT_TIMEOUT_S,
                 config: Optional[ClusterConfig] = None, owns_cluster: bool = False,
                 max_router_restarts: int = 3):
        from ray import serve

        self.app_name = app_name
        self.timeout_s = timeout_s
        # A router that restarts loses its batches: generate/stream submit what they have not
        # received again, this many times a batch at most (batch_follow.py).
        self.max_router_restarts = max_router_restarts
        self.router_restarts = 0  # batches this client submitted again after a router restart
        self.config = config
        self.owns_cluster = owns_cluster
        self.router = serve.get_deployment_handle("Router", app_name)
        self.call_timeout_s = config.router.call_timeout_s if config else 120.0

    # ---- lifecycle ------------------------------------------------------------------------
    @classmethod
    def start(cls, config: Union[str, ClusterConfig, dict], address: Optional[str] = None,
              wait_ready_s: float = 600.0, **ray_init) -> "RolloutClient":
        """Start (or join) Ray, deploy the application, and wait until every replica is up."""
        import ray
        from ray import serve

        from .serve.app import build_app

        cfg = load_config(config)
        if not ray.is_initialized():
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}}
            ray.init(address=address, runtime_env=env, **ray_init)
        serve.start(http_options={"host": "127.0.0.1", "port": int(os.environ.get("ROLLOUT_HTTP_PORT", 8000))})
        t0 = time.monotonic()
        deploy(build_app(cfg), cfg, wait_ready_s)
        client = cls(cfg.app_name, config=cfg, owns_cluster=address is None)
        client.wait_ready(cfg.replicas, max(1.0, wait_ready_s - (time.monotonic() - t0)))
        return client

    @classmethod
    def connect(cls, app_name: str = "rollout", address: str = "auto", wait_s: float = 0.0,
                **kw) -> "RolloutClient":
        """Join an app that runs (or, within `wait_s`, appears: `serve deploy` and a RayService
        build the app after they return)."""
        import ray

        if not ray.is_initialized():
            ray.init(address=address)
        from ray.serve.exceptions import RayServeException

        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls(app_name, **kw)
            except (KeyError, RayServeException):  # no such app yet, or Serve itself not up yet
                if time.monotonic() >= deadline:
                    raise KeyError(f"app_name={app_name!r}: no such Serve application with a Router "
                                   f"after {wait_s:.0f} s (`serve status` lists the applications)") from None
                time.sleep(0.5)

    def wait_ready(self, replicas: int, timeout_s: float = 600.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if len(st["replicas"]) >= replicas and st["model"]:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(st['replicas'])} of {replicas} replicas pulling after {timeout_s:.0f} s")
            time.sleep(0.5)

    def status(self) -> dict:
        return self.router.status.remote().result(timeout_s=self.call_timeout_s)

    def sampling_defaults(self) -> dict:
        """The app's `sampling` section as SamplingSpec fields: what generate/stream use when called
        without `sampling`, and what a JSONL line leaves out. Asked of the router each time: the
        running app's config is the one that counts (a job may attach to an app deployed with
        another, and a long-lived client may outlive a redeploy)."""
        return self.status().get("sampling_defaults", {})

    def default_sampling(self) -> SamplingSpec:
        return SamplingSpec(**self.sampling_defaults())

    def update_weights(self, path: str, version: Optional[int] = None, timeout_s: float = 600.0) -> int:
        """Load the checkpoint in `path` (a directory every replica's node can read, same
        architecture as the served model) into every replica, between batches; returns once all of
        them hold it. `version` (default: current + 1) tags every Completion generated with these
        weights. Raises if a batch is unfinished, or with every replica's error once each replica
        has either loaded or failed. A replica whose load failed gets no work until a later update
        succeeds; one that vLLM left half loaded also restarts (Serve's health check) and loads again.
        While the engines sleep it returns at once: they load at wake(), which waits for it. A load
        still running (a replacement replica loading the current weights) is waited for first,
        within `timeout_s`: the router refuses a second load beside it."""
        self._wait_for_loads(time.monotonic() + timeout_s)
        v = self.router.update_weights.remote(path, version).result(timeout_s=self.call_timeout_s)
        if self.status()["sleep"]["level"]:
            return v  # asleep: the engines load it when they wake (wake() waits for it)
        expected = self.status().get("expected_replicas") or (self.config.replicas if self.config else 1)
        deadline = time.monotonic() + timeout_s
        while True:
            w = self.status()["weights"]
            if w["version"] != v:
                raise RuntimeError(f"update_weights: version {v} was replaced by {w['version']} meanwhile")
            held = [rid for rid, rv in w["replicas"].items() if rv == v]
            settled = len(held) + len(w["errors"]) >= max(expected, len(w["replicas"]))
            if w["errors"] and settled:
                raise RuntimeError(f"update_weights to version {v} ({path!r}) failed on {len(w['errors'])} "
                                   f"replica(s): {'; '.join(sorted(w['errors'].values()))}")
            if settled:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"update_weights: {len(held)} of {max(expected, len(w['replicas']))} replicas "
                                   f"hold version {v} after {timeout_s:.0f} s")
            time.sleep(0.1)

    def _wait_for_loads(self, deadline: float) -> None:
        """Until every awake replica holds the current weights or failed loading them (past the
        deadline the router's refusal names the loads)."""
        while time.monotonic() < deadline:
            st = self.status()
            w = st["weights"]
            if st["sleep"]["level"] or all(v == w["version"] or rid in w["errors"] for rid, v in w["replicas"].items()):
                return
            time.sleep(0.2)

    def sleep(self, level: int = 1, timeout_s: float = 600.0) -> dict:
        """Put every engine to sleep between batches (vLLM sleep mode), so a trainer on the same GPUs
        gets their memory: level 1 moves the weights to host memory and drops the KV cache; level 2
        drops both, and wake() reloads the latest weights (update_weights' checkpoint, else the
        config's model, which must then be a local checkpoint). On GPUs it needs
        engine.enable_sleep_mode. Returns once every replica sleeps; raises with each replica's
        error once the rest are settled (they sleep: wake() wakes them all). A batch submitted
        before wake() is refused."""
        self.router.sleep.remote(level).result(timeout_s=self.call_timeout_s)
        return self._wait_sleep(level, "sleep", time.monotonic() + timeout_s, timeout_s)

    def wake(self, timeout_s: float = 600.0) -> dict:
        """Wake every engine; returns once each is awake and holds the current weights or failed
        loading them (status()["weights"]["errors"]: those get no work). A level-2 sleeper reloads
        them; an update_weights made while asleep loads now."""
        self.router.wake.remote().result(timeout_s=self.call_timeout_s)
        deadline = time.monotonic() + timeout_s
        st = self._wait_sleep(0, "wake", deadline, timeout_s)
        while True:
            w = st["weights"]
            behind = [rid for rid, rv in w["replicas"].items() if rv != w["version"] and rid not in w["errors"]]
            if not behind:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"wake: {len(behind)} replica(s) still load weights version {w['version']} "
                                   f"after {timeout_s:.0f} s")
            time.sleep(0.1)
            st = self.status()

    def _wait_sleep(self, level: int, what: str, deadline: float, timeout_s: float) -> dict:
        """The status once every replica is at `level` or failed getting there."""
        while True:
            st = self.status()
            sl = st["sleep"]
            if sl["level"] != level:
                raise RuntimeError(f"{what}: the fleet's sleep level was changed to {sl['level']} meanwhile")
            expected = max(st.get("expected_replicas") or 1, len(st["replicas"]))
            at = [rid for rid in st["replicas"] if sl["replicas"].get(rid) == level]
            if len(at) + len(sl["errors"]) >= expected:
                if sl["errors"]:
                    raise RuntimeError(f"{what}: failed on {len(sl['errors'])} replica(s): "
                                       + "; ".join(sorted(sl["errors"].values())))
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {len(at)} of {expected} replicas at sleep level {level} "
                                   f"after {timeout_s:.0f} s")
            time.sleep(0.1)

    def scale(self, replicas: int, timeout_s: float = 600.0) -> dict:
        """Grow or shrink the engine fleet to `replicas`, in place, between or during batches: the
        router keeps running with its live batches. A replica that Serve stops hands its running
        sequences back with every token generated so far, and the others continue them; a new one
        takes work once its engine is up. The router counts `replicas` at once (static's shares,
        chunked's first round). Returns its status once exactly `replicas` replicas pull and Serve
        runs as many. Past `timeout_s` (replicas that no node can host, say) it raises
        TimeoutError with Serve's replica states; the target stays, and Serve keeps trying.
        Growing a sleeping fleet is refused (wake() first). Uses Serve's external scaling
        API: `RolloutClient.start` enables it; an app from a Serve config needs
        `external_scaler_enabled: true` on its application. A RayService's own num_replicas
        applies again only when its EngineReplica entry in serveConfigV2 changes (k8s/README.md)."""
        import ray
        from ray import serve
        from ray.serve._private.common import DeploymentID
        from ray.serve._private.exceptions import ExternalScalerDisabledError
        from ray.serve.context import _get_global_client

        check_replicas(replicas)
        st = self.status()
        if replicas > max(len(st["replicas"]), st["expected_replicas"]) and st["sleep"]["level"]:
            raise RuntimeError(f"scale: the fleet sleeps (level {st['sleep']['level']}); wake() first, then grow it to "
                               f"{replicas}: a new replica allocates its engine's memory before it learns the fleet "
                               "sleeps. Shrinking a sleeping fleet is allowed")
        controller = _get_global_client()._controller
        try:
            ray.get(controller.update_deployment_replicas.remote(
                DeploymentID(name=REPLICA_DEPLOYMENT, app_name=self.app_name), replicas), timeout=self.call_timeout_s)
        except ExternalScalerDisabledError:
            raise RuntimeError(
                f"scale: Serve application {self.app_name!r} was deployed without external_scaler_enabled, so "
                "Serve refuses to scale it from a driver. Set `external_scaler_enabled: true` on the application "
                "in its Serve config (RolloutClient.start sets it), or change EngineReplica's num_replicas under "
                "`deployments:` and apply the config (serve deploy, or a RayService's serveConfigV2)") from None
        # The router counts on the target at once (static's shares, chunked's first round), and
        # keeps it if this call times out or is interrupted.
        self.router.set_fleet_target.remote(replicas).result(timeout_s=self.call_timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            app = serve.status().applications.get(self.app_name)
            dep = app.deployments.get(REPLICA_DEPLOYMENT) if app else None
            states = {getattr(k, "value", str(k)): v for k, v in (dep.replica_states if dep else {}).items() if v}
            if len(st["replicas"]) == replicas and states == {"RUNNING": replicas}:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"scale: the fleet is not at {replicas} after {timeout_s:.0f} s: {len(st['replicas'])} replicas "
                    f"pull from the router, and Serve's EngineReplica replicas are {states or 'none'} "
                    f"({_one_line(dep.message if dep else '')}). The target stays {replicas}: Serve keeps trying "
                    "(scale() again to change it)")
            time.sleep(0.2)

    def set_policy(self, name: str, **params) -> str:
        return self.router.set_policy.remote({"name": name, **params}).result(timeout_s=self.call_timeout_s)

    def cancel(self, batch_id: str) -> int:
        """Stop a batch: its unfinished sequences come back with finish_reason "abort"."""
        return self.router.cancel.remote(batch_id).result(timeout_s=self.call_timeout_s)

    def _cancel_quietly(self, batch_id: str) -> bool:
        try:
            self.cancel(batch_id)
            return True
        except Exception:
            return False

    def set_trace(self, on: bool = True) -> None:
        self.router.set_trace.remote(on).result(timeout_s=self.call_timeout_s)

    def take_trace(self, batch_id: str) -> list:
        return self.router.take_trace.remote(batch_id).result(timeout_s=self.call_timeout_s)

    def take_step_samples(self) -> list:
        """[(running, context tokens, seconds per token per sequence)] that replicas reported while tracing."""
        return self.router.take_step_samples.remote().result(timeout_s=self.call_timeout_s)

    def shutdown(self) -> None:
        """Delete this client's app. Disconnects from Ray if `start` connected; a local cluster
        that `start` created ends with it, a cluster it joined (`ray start`) keeps running."""
        from ray import serve

        serve.delete(self.app_name)
        if self.owns_cluster:
            import ray

            ray.shutdown()

    # ---- generation -----------------------------------------------------------------------
    def submit(self, requests: list, wait_for_replica_s: Optional[float] = None,
               weights_version: Optional[int] = None) -> str:
        """Queue a batch and return its id without waiting; fetch it with router.fetch, as
        run_requests does. A batch nobody fetches from for router.abandoned_batch_s (900 s) is taken
        for one whose driver died, and dropped: a trainer that submits step k+1 and trains on step k
        for longer must fetch meanwhile, or raise the setting. With `weights_version`, a fleet on
        other weights refuses the batch (WeightsVersionError, an InputError)."""
        return self._submit(requests, wait_for_replica_s, weights_version)["batch_id"]

    def _submit(self, requests: list, wait_for_replica_s: Optional[float], weights_version: Optional[int],
                previous_ids: Optional[list] = None) -> dict:
        """{"batch_id", "weights_version"}: the batch's id and the weights it runs on."""
        return self.router.submit_batch.remote(requests, wait_for_replica_s, weights_version, previous_ids).result(
            timeout_s=self.call_timeout_s + (wait_for_replica_s or 0))

    def generate(self, prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec], None] = None,
                 progress: bool = False, timeout_s: Optional[float] = None,
                 hidden_lengths: Optional[Sequence] = None, wait_for_replica_s: Optional[float] = None,
                 weights_version: Optional[int] = None, finish_fraction: Optional[float] = None,
                 finish_by: str = "sample") -> list:
        """One Completion per (prompt, sample), in input order. Without `sampling`, the app's
        `sampling` section (sampling_defaults) applies to every prompt. `weights_version` (the
        version update_weights returned) makes sure every sample comes from those weights: a fleet
        on others refuses the batch (WeightsVersionError). Without it the batch runs on the current
        weights, and a resubmission after a router restart asks for the same ones.

        Partial rollouts: with `finish_fraction` (0.9, say) the batch is cut once that share of its
        sequences is done (`finish_by="group"`: of its prompts, every sample of one done); the rest
        come back with finish_reason "abort" and their tokens and logprobs so far.
        `partials(prompts, results)` makes them `Partial`s, and a later batch takes those among its
        prompts: each continues after its tokens (resume.py)."""
        requests = expand(prompts, self.default_sampling() if sampling is None else sampling, hidden_lengths)
        return self.run_requests(requests, progress, timeout_s, wait_for_replica_s, weights_version, finish_fraction,
                                 finish_by)

    def run_requests(self, requests: list, progress: bool = False, timeout_s: Optional[float] = None,
                     wait_for_replica_s: Optional[float] = None, weights_version: Optional[int] = None,
                     finish_fraction: Optional[float] = None, finish_by: str = "sample") -> list:
        follow = BatchAcrossRestarts(requests, self.max_router_restarts, finish_fraction, finish_by)
        t0 = time.monotonic()
        follow.submitted(self._submit(requests, wait_for_replica_s, weights_version))
        self.last_batch_id = follow.batch_id
        bar = _bar(len(requests), progress)
        deadline = t0 + (timeout_s or self.timeout_s)
        gone = None
        while not follow.done:
            if time.monotonic() > deadline:
                self._cancel_quietly(follow.batch_id)
                raise follow.timed_out(timeout_s or self.timeout_s)
            try:
                new, cursor, _ = self.router.fetch.remote(follow.batch_id, follow.cursor, 1.0).result(
                    timeout_s=self.call_timeout_s)
            except BatchLostError as lost:
                again = follow.resubmission(lost)
                note_restart(follow, lost, len(again))
                self._count_restart()
                try:
                    answer = self._submit(again, wait_for_replica_s, follow.weights_version, follow.previous_ids)
                except WeightsVersionError as other:
                    raise follow.on_other_weights(lost, other) from other
                follow.submitted(answer, time.monotonic() - t0)
                self.last_batch_id = follow.batch_id
                continue
            except Exception as e:
                gone = router_gone(e, gone, self.call_timeout_s)  # it died under the call: ask the next one
                time.sleep(0.5)
                continue
            gone = None
            placed = follow.take(new, cursor)
            if bar:
                bar.update(len(placed))
            if follow.should_cut():
                follow.cut = self._cancel_quietly(follow.batch_id)
        if bar:
            bar.close()
        return follow.results

    async def stream(self, prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec], None] = None,
                     timeout_s: Optional[float] = None, weights_version: Optional[int] = None,
                     finish_fraction: Optional[float] = None, finish_by: str = "sample") -> AsyncIterator[Completion]:
        """Completions as they finish (not in input order). Without `sampling`, and with
        `weights_version`, `finish_fraction` and `finish_by`, as generate. A router restart resubmits what was
        not yielded yet, on the same weights, as generate does."""
        if sampling is None:
            status = await asyncio.wait_for(self.router.status.remote(), self.call_timeout_s)
            sampling = SamplingSpec(**status.get("sampling_defaults", {}))
        async for c in follow_batch(self.router, expand(prompts, sampling), timeout_s or self.timeout_s,
                                    self.call_timeout_s, self.max_router_restarts, weights_version,
                                    on_restart=self._count_restart, finish_fraction=finish_fraction,
                                    finish_by=finish_by):
            yield c

    def _count_restart(self) -> None:
        self.router_restarts += 1


def router_gone(error: Exception, since: Optional[float], call_timeout_s: float) -> float:
    """A fetch failed because the router's process died under the call, or the call went
    unanswered for call_timeout_s (a call to a router killed under it can be). Serve starts a
    new router, which answers the next fetch with BatchLostError; fetching again is safe (a
    fetch only reads). Anything else, or a router gone for longer than call_timeout_s more,
    is raised. Returns since when it is gone."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    now = time.monotonic()
    if not isinstance(error, (RayActorError, ActorUnavailableError, TimeoutError)):
        raise error
    if since is not None and now - since > call_timeout_s:
        raise TimeoutError(f"the router has not answered for {now - since:.0f} s since it died "
                           f"(call_timeout_s={call_timeout_s:g}): {error}") from error
    if since is None:
        log.warning("the router died under a fetch (%r); waiting for Serve's new one", error)
    return now if since is None else since


def note_restart(follow: BatchAcrossRestarts, lost: BatchLostError, again: int) -> None:
    log.warning("%s; submitting the %d sequences not received again (%d of %d received)",
                lost.args[0] if lost.args else lost, again, follow.received, len(follow.requests))


async def follow_batch(router, requests: list, timeout_s: float, call_timeout_s: float = 120.0,
                       max_restarts: int = 3, weights_version: Optional[int] = None,
                       on_restart=None, finish_fraction: Optional[float] = None,
                       finish_by: str = "sample") -> AsyncIterator[Completion]:
    """Submit `requests` as one batch and yield its completions as they finish, long-polling the
    router's `fetch`. A router restart loses the batch: what was not yielded yet is submitted
    again, on the weights the first submission ran on (batch_follow.py), at most `max_restarts`
    times. Past `timeout_s` the batch is cancelled and TimeoutError raised. RolloutClient.stream
    and the HTTP route (serve/app.py, a deployment of its own that outlives the router) use it."""
    follow = BatchAcrossRestarts(requests, max_restarts, finish_fraction, finish_by)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    follow.submitted(await asyncio.wait_for(router.submit_batch.remote(requests, None, weights_version),
                                            call_timeout_s))
    gone = None
    while not follow.done:
        if time.monotonic() > deadline:
            try:
                await asyncio.wait_for(router.cancel.remote(follow.batch_id), call_timeout_s)
            except Exception:
                pass
            raise follow.timed_out(timeout_s)
        try:
            new, cursor, _ = await asyncio.wait_for(
                router.fetch.remote(follow.batch_id, follow.cursor, 1.0), call_timeout_s)
        except BatchLostError as lost:
            again = follow.resubmission(lost)
            note_restart(follow, lost, len(again))
            if on_restart is not None:
                on_restart()
            try:
                answer = await asyncio.wait_for(
                    router.submit_batch.remote(again, None, follow.weights_version, follow.previous_ids),
                    call_timeout_s)
            except WeightsVersionError as other:
                raise follow.on_other_weights(lost, other) from other
            follow.submitted(answer, time.monotonic() - t0)
            continue
        except Exception as e:
            gone = router_gone(e, gone, call_timeout_s)
            await asyncio.sleep(0.5)
            continue
        gone = None
        for c in follow.take(new, cursor):
            yield c
        if follow.should_cut():
            try:
                await asyncio.wait_for(router.cancel.remote(follow.batch_id), call_timeout_s)
                follow.cut = True
            except Exception:
                pass  # the next fetch finds out what happened to the router


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="sequences", unit="seq")


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
