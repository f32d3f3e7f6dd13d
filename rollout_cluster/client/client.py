"""RolloutClient: the driver API. Submit a batch, get every completion back.

    client = RolloutClient.start("configs/local-cpu.yaml")   # local Ray + the Serve app
    client = RolloutClient.connect(app_name="rollout")          # an app that already runs
    results = client.generate(prompts, SamplingSpec(n=4, max_tokens=256))
    async for c in client.stream(prompts, sampling): ...

Every call is bounded: a router that does not answer within `timeout_s` raises TimeoutError.
The methods carry the docstrings; the work is done by the modules beside this one, as functions
of the client: lifecycle.py starts, joins and deletes the app; a batch is followed by the sans-I/O
BatchFollower (follower.py) through loops.py's drivers (batches.py); the fleet operations wait in
fleet_ops.py.
"""
from __future__ import annotations

import math
from typing import AsyncIterator, Optional, Sequence, Union

from ..config import ClusterConfig
from ..protocol import Completion, InputError, SamplingSpec, check_replicas, check_wait_s, is_number
from . import batches, fleet_ops, lifecycle
from .expand import expand
from .follower import DEFAULT_TIMEOUT_S


def checked_wait(timeout_s) -> float:
    """A fleet operation's `timeout_s`, refused before any order goes out unless it is a wait: an
    order sent with none would be carried out while the call failed at once."""
    if not (is_number(timeout_s) and math.isfinite(timeout_s) and timeout_s > 0):
        raise InputError("timeout_s", timeout_s, "must be a finite number of seconds > 0")
    return timeout_s


class RolloutClient:
    def __init__(self, app_name: str = "rollout", timeout_s: float = DEFAULT_TIMEOUT_S,
                 config: Optional[ClusterConfig] = None, owns_cluster: bool = False,
                 max_router_restarts: int = 3, control_keys_file: Optional[str] = None):
        self.app_name = app_name
        self.timeout_s = timeout_s
        # A router that restarts loses its batches: generate/stream submit what they have not
        # received again, this many times a batch at most (follower.py).
        self.max_router_restarts = max_router_restarts
        self.router_restarts = 0  # batches this client submitted again after a router restart
        self.config = config
        self.owns_cluster = owns_cluster
        self.router = lifecycle.signed_router(app_name, config, control_keys_file)
        self.call_timeout_s = config.router.call_timeout_s if config else 120.0

    # ---- lifecycle ------------------------------------------------------------------------
    @classmethod
    def start(cls, config: Union[str, ClusterConfig, dict], address: Optional[str] = None,
              wait_ready_s: float = 600.0, **ray_init) -> "RolloutClient":
        """Start (or join) Ray, deploy the application, and wait until every replica is up."""
        return lifecycle.start(cls, config, address, wait_ready_s, ray_init)

    @classmethod
    def connect(cls, app_name: str = "rollout", address: str = "auto", wait_s: float = 0.0,
                **kw) -> "RolloutClient":
        """Join an app that runs (or, within `wait_s`, appears: `serve deploy` and a RayService
        build the app after they return)."""
        return lifecycle.connect(cls, app_name, address, wait_s, kw)

    def wait_ready(self, replicas: int, timeout_s: float = 600.0) -> dict:
        check_replicas(replicas)
        return fleet_ops.wait_ready(self, replicas, checked_wait(timeout_s))

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

    def update_weights(self, path: str, version: Optional[int] = None, timeout_s: float = 600.0,
                       running: str = "finish") -> int:
        """Load the checkpoint in `path` (a directory every replica's node can read, same
        architecture as the served model) into every replica, between batches; returns once all of
        them hold it. `version` (default: current + 1) tags every Completion generated with these
        weights. Raises if a batch is unfinished, or with every replica's error once each replica
        has either loaded or failed. A replica whose load failed gets no work until a later update
        succeeds; one that vLLM left half loaded also restarts (Serve's health check) and loads again.
        While the engines sleep it returns at once: they load at wake(), which waits for it. A load
        still running (a replacement replica loading the current weights) is waited for first,
        within `timeout_s`: the router refuses a second load beside it.

        `running`, for sequences that run now (asynchronous RL): "finish" waits until they end (within
        `timeout_s`); "keep" swaps the weights between two engine steps and lets them go on over the
        KV cache they have (PipelineRL's choice: fastest, the tokens after the swap come from the new
        weights over the old ones' cache); "recompute" gives them up and continues them on the new
        weights by re-prefill (exact); "abort" ends them as "abort" with their tokens (partial
        rollouts to resume). Each Completion's `weight_versions` says which version made which of
        its tokens."""
        return fleet_ops.update_weights(self, path, version, checked_wait(timeout_s), running)

    def push_weights(self, named_tensors, version: Optional[int] = None, timeout_s: float = 600.0,
                     bucket_bytes: int = 256 << 20, running: str = "finish", transport: str = "object_store",
                     stream: Optional[bool] = None) -> int:
        """Load the trainer's tensors into every replica without a checkpoint: `named_tensors`
        ((name, tensor) pairs in the served checkpoint's names and shapes, e.g.
        `model.named_parameters()` or `model.state_dict().items()` of the same architecture) go to
        Ray's object store in buckets of about `bucket_bytes`, and every replica loads them in place,
        between batches. Returns once every replica holds `version` (default: current + 1), raising
        with each replica's error as update_weights does; a replica that joins later loads them
        before it takes work. The tensors live in this process's object store: keep the process up
        while the fleet may still need them (until the next push). `running`: as update_weights'.
        Tensors on a GPU (or strided views) reach host memory through one buffer of a bucket's
        size that this process keeps from push to push, pinned (transfer/staging.py); shutdown()
        frees it.

        `stream` (None: on, unless ROLLOUT_PUSH_STREAM=0): the order goes out with the first
        bucket and the replicas load while this process puts the rest. It goes through
        `named_tensors` once first, to plan the buckets, and holds every tensor until it is
        packed: free for tensors the trainer holds anyway (its parameters, a state_dict), but a
        generator that gathers shards on the fly (FSDP's full tensors) would then hold the whole
        model at once; pass stream=False for it (each tensor is packed as it comes, and the order
        waits for the last bucket).

        `transport="ipc"` (co-location: the trainer's CUDA tensors on the GPU a replica's engine
        uses): the buckets carry CUDA IPC handles, and the engine copies the tensors straight from
        this process's GPU memory (transfer/ipc.py). Every tensor on one GPU; the fleet awake;
        not with running="keep". The tensors are held until every replica loaded, then let go: a
        replica on another GPU or host, or one that joins later, fails loading this version (its
        error says why) and gets the next push."""
        return fleet_ops.push_weights(self, named_tensors, version, bucket_bytes, checked_wait(timeout_s), running,
                                      transport, stream)

    def sleep(self, level: int = 1, timeout_s: float = 600.0) -> dict:
        """Put every engine to sleep between batches (vLLM sleep mode), so a trainer on the same GPUs
        gets their memory: level 1 moves the weights to host memory and drops the KV cache; level 2
        drops both, and wake() reloads the latest weights (update_weights' checkpoint, else the
        config's model, which must then be a local checkpoint). On GPUs it needs
        engine.enable_sleep_mode. Returns once every replica sleeps; raises with each replica's
        error once the rest are settled (they sleep: wake() wakes them all). A batch submitted
        before wake() is refused."""
        return fleet_ops.sleep(self, level, checked_wait(timeout_s))

    def wake(self, timeout_s: float = 600.0) -> dict:
        """Wake every engine; returns once each is awake and holds the current weights or failed
        loading them (status()["weights"]["errors"]: those get no work). A level-2 sleeper reloads
        them; an update_weights made while asleep loads now."""
        return fleet_ops.wake(self, checked_wait(timeout_s))

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
        return fleet_ops.scale(self, replicas, checked_wait(timeout_s))

    def set_policy(self, name: str, **params) -> str:
        return self.router.set_policy.remote({"name": name, **params}).result(timeout_s=self.call_timeout_s)

    def reset_prefix_cache(self) -> int:
        """Every engine drops its prefix cache at its next pull (what TRL asks after a weights update;
        update_weights does it by itself). Returns how many replicas were ordered."""
        return self.router.reset_prefix_cache.remote().result(timeout_s=self.call_timeout_s)

    def weights_digest(self, timeout_s: float = 120.0, detail: bool = False) -> dict:
        """{replica_id: {"version": the weights version it holds, "digest": 16 hex digits over every
        parameter of its engine's model, bit for bit (engines/weight_digest.py), "seconds": how long
        it took}}: replicas with equal digests hold identical weights. With `detail`, also "params":
        {name: {"digest", "dtype", "shape"}} (vLLM's parameter names, fused and sharded as it holds
        them). Computed on each engine's device, between engine steps; refused while weights load
        or the fleet sleeps, and a replica whose load overlapped its digest fails the call."""
        return fleet_ops.weights_digest(self, detail, checked_wait(timeout_s))

    def cancel(self, batch_id: str) -> int:
        """Stop a batch: its unfinished sequences come back with finish_reason "abort"."""
        return self.router.cancel.remote(batch_id).result(timeout_s=self.call_timeout_s)

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
        lifecycle.shutdown(self)

    # ---- generation -----------------------------------------------------------------------
    def submit(self, requests: list, wait_for_replica_s: Optional[float] = None,
               weights_version: Optional[int] = None) -> str:
        """Queue a batch and return its id without waiting; fetch it with router.fetch, as
        run_requests does. A batch nobody fetches from for router.abandoned_batch_s (900 s) is taken
        for one whose driver died, and dropped: a trainer that submits step k+1 and trains on step k
        for longer must fetch meanwhile, or raise the setting. A batch fetched whole is kept for a
        retry of that fetch until a fetch from its end (cursor = its size, as run_requests sends)
        or router.finished_batch_keep_s. With `weights_version`, a fleet on other weights refuses
        the batch (WeightsVersionError, an InputError)."""
        check_wait_s("wait_for_replica_s", wait_for_replica_s)
        wait = batches.router_wait_s(self) if wait_for_replica_s is None else wait_for_replica_s
        answer = self.router.submit_batch.remote(requests, wait_for_replica_s, weights_version).result(
            timeout_s=self.call_timeout_s + wait)  # the router's wait for a live replica, then the call's
        return answer["batch_id"]

    def generate(self, prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec], None] = None,
                 progress: bool = False, timeout_s: Optional[float] = None,
                 hidden_lengths: Optional[Sequence] = None, wait_for_replica_s: Optional[float] = None,
                 weights_version: Optional[int] = None, finish_fraction: Optional[float] = None,
                 finish_by: str = "sample", sessions: Optional[Sequence] = None) -> list:
        """One Completion per (prompt, sample), in input order. Without `sampling`, the app's
        `sampling` section (sampling_defaults) applies to every prompt. `weights_version` (the
        version update_weights returned) makes sure every sample comes from those weights: a fleet
        on others refuses the batch (WeightsVersionError). Without it the batch runs on the current
        weights, and a resubmission after a router restart asks for the same ones.

        Partial rollouts: with `finish_fraction` (0.9, say) the batch is cut once that share of its
        sequences is done (`finish_by="group"`: of its prompts, every sample of one done); the rest
        come back with finish_reason "abort" and their tokens and logprobs so far.
        `partials(prompts, results)` makes them `Partial`s, and a later batch takes those among its
        prompts: each continues after its tokens (resume.py).

        Multi-turn agents: `sessions` gives each prompt a session id (or None); a session's next
        turn goes to the replica that ran its previous one while it has room (its prefix is cached
        there: router/sessions.py)."""
        requests = expand(prompts, self.default_sampling() if sampling is None else sampling, hidden_lengths,
                          sessions)
        return self.run_requests(requests, progress, timeout_s, wait_for_replica_s, weights_version, finish_fraction,
                                 finish_by)

    def run_requests(self, requests: list, progress: bool = False, timeout_s: Optional[float] = None,
                     wait_for_replica_s: Optional[float] = None, weights_version: Optional[int] = None,
                     finish_fraction: Optional[float] = None, finish_by: str = "sample") -> list:
        return batches.run_requests(self, requests, progress, timeout_s, wait_for_replica_s, weights_version,
                                    finish_fraction, finish_by)

    async def stream(self, prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec], None] = None,
                     timeout_s: Optional[float] = None, weights_version: Optional[int] = None,
                     finish_fraction: Optional[float] = None, finish_by: str = "sample",
                     sessions: Optional[Sequence] = None) -> AsyncIterator[Completion]:
        """Completions as they finish (not in input order). Without `sampling`, and with
        `weights_version`, `finish_fraction`, `finish_by` and `sessions`, as generate. A router restart resubmits what was
        not yielded yet, on the same weights, as generate does."""
        async for c in batches.stream(self, prompts, sampling, timeout_s, weights_version, finish_fraction, finish_by,
                                      sessions):
            yield c

    def _count_restart(self) -> None:
        self.router_restarts += 1

    def _note_batch(self, batch_id: str) -> None:
        self.last_batch_id = batch_id
