"""What RolloutClient does to the whole fleet (update_weights, sleep, wake, scale, wait_ready):
order it from the router, then poll the router's status until every replica got there.

Every wait is `wait_until`: one deadline loop whose predicate returns the result once the fleet
is settled, None while it is not, or raises RuntimeError when it settled in failure; past the
deadline it raises TimeoutError with what the predicate's caller says about the last status.
The client's methods carry the docstrings; these functions take the client.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Callable, Optional

from ..protocol import InputError, WeightsNotLearned, check_replicas, check_weights_order
from ..serve.fleet_target import REPLICA_DEPLOYMENT

log = logging.getLogger(__name__)
VERSION_FIRST_POLL_S = 0.01  # a weights wait polls the router's status this soon first, then doubling to 0.1 s
NUMBER_RETRY_S = 0.5  # a weights order a new router refused (WeightsNotLearned) is asked again this often


def wait_until(probe: Callable[[], object], settled: Callable[[object], object], deadline: float,
               interval_s: float, timed_out: Callable[[object], Optional[Exception]],
               first_interval_s: Optional[float] = None, sleep: Callable[[float], None] = time.sleep):
    """probe() until settled(value) returns something other than None, and return that. Past
    `deadline` (time.monotonic()) raise timed_out(last value), or return None where it gives no
    error (a wait that may end unsettled). The probes are interval_s apart; with
    `first_interval_s`, the first gap is that and each next one doubles up to interval_s (a wait
    that usually ends within a fraction of a second, as a weights load, sees its end sooner)."""
    gap = interval_s if first_interval_s is None else min(first_interval_s, interval_s)
    while True:
        value = probe()
        done = settled(value)
        if done is not None:
            return done
        if time.monotonic() > deadline:
            error = timed_out(value)
            if error is None:
                return None
            raise error
        sleep(gap)
        gap = min(2 * gap, interval_s)


def wait_ready(client, replicas: int, timeout_s: float) -> dict:
    return wait_until(client.status, lambda st: st if len(st["replicas"]) >= replicas and st["model"] else None,
                      time.monotonic() + timeout_s, 0.5,
                      lambda st: TimeoutError(f"{len(st['replicas'])} of {replicas} replicas pulling after "
                                              f"{timeout_s:.0f} s"))


def before_update(client, running: str, deadline: float) -> None:
    """A load still running (a replacement replica loading the current weights) first: the router
    refuses a second load beside it. With running="finish", the sequences that run now end first.
    Past the deadline the router's refusal names what is left."""
    wait_until(client.status, _loads_settled, deadline, 0.2, lambda st: None)
    if running == "finish":
        wait_until(client.status, lambda st: True if st["live_sequences"] == 0 else None, deadline, 0.2,
                   lambda st: None)


def numbered(order: Callable[[], int], deadline: float) -> int:
    """order() (a weights order, signed anew at each call) until the router numbers it: a new or
    restarted router refuses one (WeightsNotLearned, nothing changed) until it has heard every
    replica's weights, at most router.replica_timeout_s. Past `deadline` its refusal is raised."""
    while True:
        try:
            return order()
        except WeightsNotLearned as e:
            if time.monotonic() + NUMBER_RETRY_S > deadline:
                raise
            log.info("%s", e)
            time.sleep(NUMBER_RETRY_S)


def update_weights(client, path: str, version: Optional[int], timeout_s: float, running: str = "finish") -> int:
    check_weights_order(version, running)  # (before the fleet is waited for)
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path.strip():
        raise InputError("path", path, "must be a checkpoint folder's path (a non-empty string or a pathlib.Path)")
    # absolute: the router checks it against security.checkpoint_roots, the replicas load it
    path = os.path.abspath(path)
    deadline = time.monotonic() + timeout_s
    before_update(client, running, deadline)
    v = numbered(lambda: client.router.update_weights.remote(path, version, running).result(
        timeout_s=client.call_timeout_s), deadline)
    return wait_for_version(client, v, repr(path), "update_weights", timeout_s, deadline)


def push_weights(client, named_tensors, version: Optional[int], bucket_bytes: int, timeout_s: float,
                 running: str = "finish", transport: str = "object_store", stream: Optional[bool] = None) -> int:
    from ..transfer.buckets import check_bucket_bytes
    from ..transfer.ipc import IpcHold, check_transport
    from ..transfer.lease import lease_of_this_process
    from ..transfer.push import check_stream, push

    check_weights_order(version, running)  # (before the fleet is waited for and the model put)
    check_transport(transport, running)
    check_stream(stream)
    check_bucket_bytes(bucket_bytes)
    check_named_tensors(named_tensors)
    hold = None
    if transport == "ipc":
        level = client.status()["sleep"]["level"]
        if level:  # asleep, the engines would load at wake: after this call let the tensors go
            raise RuntimeError(f"push_weights(transport='ipc'): the fleet sleeps (level {level}); wake() first: "
                               "the engines open the trainer's tensors while this call holds them")
        hold = IpcHold.start()
    try:
        deadline = time.monotonic() + timeout_s
        before_update(client, running, deadline)
        v, source, _ = push(client.router.handle, client.router.signer, named_tensors, version, bucket_bytes,
                            client.call_timeout_s, running, hold, until_numbered=lambda send: numbered(send, deadline),
                            lease=lease_of_this_process, stream=stream)
        return wait_for_version(client, v, source, "push_weights", timeout_s, deadline)
    finally:  # every replica loaded or failed (or the wait gave up): the handles close
        if hold is not None and not hold.release(timeout_s):
            hold.abandon()
            log.warning("push_weights: a replica still loads over CUDA IPC after %.0f s; its tensors are kept "
                        "(never freed) so that it reads no freed memory", timeout_s)


def check_named_tensors(named_tensors) -> None:
    """What is plainly not (name, tensor) pairs, refused before the fleet is waited for: a mapping
    (model.state_dict() where .items() was meant: its keys would be taken for pairs), nothing at
    all, a string. Each pair is checked as it is packed."""
    if isinstance(named_tensors, Mapping):
        raise InputError("named_tensors", f"<a {type(named_tensors).__name__} of {len(named_tensors)}>",
                         "must be (name, tensor) pairs: pass model.named_parameters() or state_dict().items()")
    if isinstance(named_tensors, (str, bytes)) or not hasattr(named_tensors, "__iter__"):
        raise InputError("named_tensors", named_tensors, "must be an iterable of (name, tensor) pairs")
    if hasattr(named_tensors, "__len__") and len(named_tensors) == 0:
        raise InputError("named_tensors", "[]", "is empty: nothing to push")


def wait_for_version(client, v: int, path: str, op: str, timeout_s: float, deadline: Optional[float] = None) -> int:
    """Wait until every replica holds version `v` or failed loading it (update_weights, push_weights),
    until `deadline` (the call's, whose `timeout_s` it is; default: timeout_s from now)."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    if client.status()["sleep"]["level"]:
        return v  # asleep: the engines load it when they wake (wake() waits for it)
    configured = client.config.replicas if client.config else 1

    def expected(st: dict) -> int:  # (read from every status: a replica that died and was not replaced lowers it)
        return max(st.get("expected_replicas") or configured, len(st["weights"]["replicas"]))

    def held(st: dict) -> list:
        """Replicas that hold `v` as the router numbered it: its number and its source (a replica
        cut off from a restarted router may hold the same number of other weights)."""
        w = st["weights"]
        return list(w["held"]) if w["version"] == v else []

    def failed(st: dict) -> dict:
        """replica -> why it will not load `v` now: its load failed, or its engine did not wake
        (it notes the version and loads it when a wake() succeeds)."""
        out = {rid: f"replica {rid} did not wake ({e}): it loads version {v} once wake() succeeds"
               for rid, e in st["sleep"].get("errors", {}).items() if rid in st["weights"]["replicas"] and rid not in held(st)}
        return {**out, **st["weights"]["errors"]}

    def settled(st: dict):
        w = st["weights"]
        if w["version"] != v:
            raise RuntimeError(f"{op}: version {v} was replaced by {w['version']} meanwhile")
        bad = failed(st)
        if len(held(st)) + len(bad) < expected(st):
            return None
        if bad:
            raise RuntimeError(f"{op} to version {v} ({path}) failed on {len(bad)} "
                               f"replica(s): {'; '.join(sorted(bad.values()))}")
        return v

    def timed_out(st: dict) -> TimeoutError:
        lacking = sorted(rid for rid in st["weights"]["replicas"] if rid not in held(st) and rid not in failed(st))
        return TimeoutError(f"{op}: {len(held(st))} of {expected(st)} replicas hold "
                            f"version {v} after {timeout_s:.0f} s; still without it: {', '.join(lacking) or 'none'}"
                            + (f" (sleep level of each: {st['sleep'].get('replicas')})" if lacking else ""))

    return wait_until(client.status, settled, deadline, 0.1, timed_out, first_interval_s=VERSION_FIRST_POLL_S)


def weights_digest(client, detail: bool, timeout_s: float) -> dict:
    ask = client.router.weights_digest.remote(detail).result(timeout_s=client.call_timeout_s)

    def probe() -> dict:
        return client.router.weights_digests.remote(ask).result(timeout_s=client.call_timeout_s)

    got = wait_until(probe, lambda a: None if a["waiting"] else a, time.monotonic() + timeout_s, 0.1,
                     lambda a: TimeoutError(f"weights_digest: replica(s) {', '.join(a['waiting'])} did not answer "
                                            f"within {timeout_s:.0f} s (a lost reply, or a busy engine): ask again"))
    errors = sorted(a["error"] for a in got["replicas"].values() if a["error"])
    if errors:
        raise RuntimeError(f"weights_digest: {len(errors)} replica(s) gave no digest: {'; '.join(errors)}")
    return {rid: {"version": a["version"], "digest": a["digest"], "seconds": a["seconds"],
                  **({"params": a["params"]} if detail else {})} for rid, a in got["replicas"].items()}


def _holds(w: dict, rid: str) -> bool:
    """Replica `rid` holds the fleet's current weights, per status()['weights'] (number and source)."""
    return rid in w["held"]


def _loads_settled(st: dict):
    """Every awake replica holds the current weights or failed loading them (or failed to wake: it
    loads them at its next wake, and no update waits for it)."""
    w, woke_not = st["weights"], st["sleep"].get("errors", {})
    if st["sleep"]["level"] or all(_holds(w, rid) or rid in w["errors"] or rid in woke_not for rid in w["replicas"]):
        return st
    return None


def sleep(client, level: int, timeout_s: float) -> dict:
    client.router.sleep.remote(level).result(timeout_s=client.call_timeout_s)
    return _wait_sleep(client, level, "sleep", time.monotonic() + timeout_s, timeout_s)


def wake(client, timeout_s: float) -> dict:
    client.router.wake.remote().result(timeout_s=client.call_timeout_s)
    deadline = time.monotonic() + timeout_s
    _wait_sleep(client, 0, "wake", deadline, timeout_s)

    def behind(st: dict) -> list:
        w = st["weights"]
        return [rid for rid in w["replicas"] if not _holds(w, rid) and rid not in w["errors"]]

    return wait_until(client.status, lambda st: None if behind(st) else st, deadline, 0.1, lambda st: TimeoutError(
        f"wake: {len(behind(st))} replica(s) still load weights version {st['weights']['version']} "
        f"after {timeout_s:.0f} s"))


def _wait_sleep(client, level: int, what: str, deadline: float, timeout_s: float) -> dict:
    """The status once every replica is at `level` or failed getting there."""
    def expected(st: dict) -> int:
        return max(st.get("expected_replicas") or 1, len(st["replicas"]))

    def at(st: dict) -> list:
        return [rid for rid in st["replicas"] if st["sleep"]["replicas"].get(rid) == level]

    def settled(st: dict):
        sl = st["sleep"]
        if sl["level"] != level:
            raise RuntimeError(f"{what}: the fleet's sleep level was changed to {sl['level']} meanwhile")
        if len(at(st)) + len(sl["errors"]) < expected(st):
            return None
        if sl["errors"]:
            raise RuntimeError(f"{what}: failed on {len(sl['errors'])} replica(s): "
                               + "; ".join(sorted(sl["errors"].values())))
        return st

    return wait_until(client.status, settled, deadline, 0.1, lambda st: TimeoutError(
        f"{what}: {len(at(st))} of {expected(st)} replicas at sleep level {level} after {timeout_s:.0f} s"))


def scale(client, replicas: int, timeout_s: float) -> dict:
    check_replicas(replicas)
    import ray
    from ray import serve
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.exceptions import ExternalScalerDisabledError
    from ray.serve.context import _get_global_client

    st = client.status()
    if replicas > max(len(st["replicas"]), st["expected_replicas"]) and st["sleep"]["level"]:
        raise RuntimeError(f"scale: the fleet sleeps (level {st['sleep']['level']}); wake() first, then grow it to "
                           f"{replicas}: a new replica allocates its engine's memory before it learns the fleet "
                           "sleeps. Shrinking a sleeping fleet is allowed")
    controller = _get_global_client()._controller
    try:
        ray.get(controller.update_deployment_replicas.remote(
            DeploymentID(name=REPLICA_DEPLOYMENT, app_name=client.app_name), replicas), timeout=client.call_timeout_s)
    except ExternalScalerDisabledError:
        raise RuntimeError(
            f"scale: Serve application {client.app_name!r} was deployed without external_scaler_enabled, so "
            "Serve refuses to scale it from a driver. Set `external_scaler_enabled: true` on the application "
            "in its Serve config (RolloutClient.start sets it), or change EngineReplica's num_replicas under "
            "`deployments:` and apply the config (serve deploy, or a RayService's serveConfigV2)") from None
    # The router counts on the target at once (static's shares, chunked's first round), and
    # keeps it if this call times out or is interrupted.
    client.router.set_fleet_target.remote(replicas).result(timeout_s=client.call_timeout_s)

    def probe() -> tuple:
        st = client.status()
        app = serve.status().applications.get(client.app_name)
        dep = app.deployments.get(REPLICA_DEPLOYMENT) if app else None
        states = {getattr(k, "value", str(k)): v for k, v in (dep.replica_states if dep else {}).items() if v}
        return st, dep, states

    return wait_until(
        probe, lambda got: got[0] if len(got[0]["replicas"]) == replicas and got[2] == {"RUNNING": replicas} else None,
        time.monotonic() + timeout_s, 0.2, lambda got: TimeoutError(
            f"scale: the fleet is not at {replicas} after {timeout_s:.0f} s: {len(got[0]['replicas'])} replicas "
            f"pull from the router, and Serve's EngineReplica replicas are {got[2] or 'none'} "
            f"({_one_line(got[1].message if got[1] else '')}). The target stays {replicas}: Serve keeps trying "
            "(scale() again to change it)"))


def _one_line(message: str) -> str:
    return " ".join((message or "").split()) or "no message"
