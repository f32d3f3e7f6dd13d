"""The replicas' report credentials: a replica registers with a signed order and gets a random
credential, which every report it sends must carry, so that no other caller can speak for it.

Owned by the Router deployment (serve/router.py); plain state beside the order verifier it counts
refusals in.
"""
from __future__ import annotations

import hmac
import logging
import secrets

from ..protocol import Report
from ..security.signing import OrderRefused, OrderVerifier

log = logging.getLogger("ray.serve")


class ReplicaCredentials:
    def __init__(self, verifier: OrderVerifier, metrics):
        self.verifier = verifier  # counts a refusal by reason (status()'s "control")
        self.metrics = metrics  # exports it (RouterMetrics.refused)
        self.issued: dict = {}  # replica_id -> the credential it reports with

    def register(self, args: dict) -> str:
        """A new credential for the replica a verified register order names (its first pull, and
        again when a restarted router does not know it)."""
        rid = args.get("replica_id")
        if not isinstance(rid, str) or not rid:
            refusal = OrderRefused("malformed", "register: replica_id must be a non-empty string")
            self.verifier.refusals[refusal.reason] += 1  # counted as refused (and as accepted: its signature held)
            self.metrics.refused(refusal.reason)
            log.warning("%s", refusal)
            raise refusal
        self.issued[rid] = credential = secrets.token_hex(16)
        return credential

    def known(self, report: Report) -> bool:
        """The report carries the credential its replica registered with. A replica this router
        never registered (it restarted) is only asked to register; a wrong credential for a
        registered one is a forgery, counted as `report_credential`."""
        expected = self.issued.get(report.replica_id) if isinstance(report.replica_id, str) else None
        if expected is None:
            return False
        given = report.credential if isinstance(report.credential, str) else ""
        if hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass")):  # (a forgery's may not encode)
            return True
        self.verifier.refusals["report_credential"] += 1
        self.metrics.refused("report_credential")
        return False

    def forget(self, replica_id: str) -> None:
        """It stopped (stalled or left): a later report of it registers again."""
        self.issued.pop(replica_id, None)
