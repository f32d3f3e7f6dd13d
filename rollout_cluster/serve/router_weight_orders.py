"""What the Router deployment checks of a weights order before the fleet is pointed at it:
a checkpoint under security.checkpoint_roots and complete (update_weights), or a push whose
object refs are the ones its signed order names (push_weights), or the push an abort names
(push_abort). A refusal is counted by reason."""
from __future__ import annotations

import asyncio
import time

from ..engines.checkpoint import check_checkpoint, root_is_here
from ..protocol import InputError
from ..security.paths import check_under_roots
from ..transfer.push import PUSH_SCHEME


def _refused(router, reason: str) -> None:
    router.verifier.refusals[reason] += 1
    router.metrics.refused(reason)


async def checked_checkpoint(router, args: dict) -> str:
    """The checkpoint path of an update_weights order, resolved; or PermissionError (outside the
    roots), InputError (a broken path, a bad version), WeightsNotLearned (a fresh router that has
    not heard its fleet yet: retry) or the checkpoint's own error."""
    sec = router.cfg.security
    try:
        path = check_under_roots(args.get("path"), sec.checkpoint_roots)
    except PermissionError:
        _refused(router, "path")
        raise
    # a broken path, a version too low, a router too new are refused before any disk work
    router.core.control.checked("update_weights", path, args.get("version"), time.monotonic())
    if router.cfg.engine.kind != "sim" and root_is_here(path, sec.checkpoint_roots):
        # Sizes only (each engine hashes before it loads), in a thread: pulls go on meanwhile.
        await asyncio.to_thread(check_checkpoint, path, sec.require_manifest, verify_sha256=False)
    return path


def checked_push(router, args: dict, buckets) -> str:
    """The source ("push://<id>") of a push_weights order whose `buckets` are the object refs the
    signed order names, in order; or InputError naming the field."""
    source, ids = args.get("source"), args.get("buckets")
    if not isinstance(source, str) or not source.startswith(PUSH_SCHEME):
        raise InputError("source", source, f"must name the push ({PUSH_SCHEME}<id>)")
    if not isinstance(buckets, list) or not buckets or [getattr(b, "hex", lambda: None)() for b in buckets] != ids:
        _refused(router, "malformed")
        raise InputError("buckets", f"<{len(buckets) if isinstance(buckets, list) else buckets!r}>",
                         "must be the object refs whose ids the signed order names, in order")
    return source


def checked_abort(args: dict) -> tuple[str, str]:
    """(source, reason) of a push_abort order; InputError naming a source that is no push. The
    reason, the trainer's words, is cut to 1,000 characters."""
    source, reason = args.get("source"), args.get("reason")
    if not isinstance(source, str) or not source.startswith(PUSH_SCHEME):
        raise InputError("source", source, f"must name the push ({PUSH_SCHEME}<id>)")
    return source, (reason if isinstance(reason, str) else repr(reason))[:1000]
