"""FleetDigests: the weights digests a driver asks of every replica (RolloutClient.weights_digest).

`ask` leaves a DigestWeights order for every live replica and returns its id; each replica answers
in a later report (Report.digest: the digest and the weights version it holds, or why not), and
`answers(ask)` says who answered and who has not yet. Only the latest ask's answers are kept.
A digest is only asked between loads and while awake: during a load it would describe no version
(a replica whose load or sleep overlaps its digest answers an error instead).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from ..protocol import DigestWeights, WeightsDigest
from .fleet import Fleet
from .outbox import Outbox
from .sleep import FleetSleep
from .weights import FleetWeights


class FleetDigests:
    def __init__(self, fleet: Fleet, outbox: Outbox, weights: FleetWeights, sleep: FleetSleep, id_prefix: str = ""):
        self.fleet, self.outbox, self.weights, self.sleep = fleet, outbox, weights, sleep
        self.id_prefix = id_prefix  # this router's: an answer to a restarted router's ask is not taken for ours
        self.asks = 0  # asks so far (numbers them)
        self.ask: Optional[str] = None  # the latest ask's id
        self.asked: set = set()  # the replicas it went to
        self.got: dict[str, WeightsDigest] = {}  # replica_id -> its answer to the latest ask

    def request(self, detail: bool = False) -> str:
        """Order every live replica to digest its weights at its next pull; returns the ask's id.
        Refused while a load runs or the fleet sleeps (or moves to or from sleep)."""
        if not isinstance(detail, bool):
            raise TypeError(f"detail={detail!r}: must be true or false")
        replicas = self.fleet.replicas
        if not replicas:
            raise RuntimeError("weights_digest: no live engine replica")
        loading = self.weights.loading(replicas) or sorted(rid for rid, r in replicas.items() if r.weights_loading)
        if loading:
            raise RuntimeError(f"weights_digest: replica(s) {', '.join(loading[:4])} still load weights; a digest "
                               "during a load describes no version: ask again once status()['weights'] shows "
                               "them settled")
        not_awake = sorted(rid for rid in replicas if not self.sleep.awake(rid))
        if self.sleep.level or not_awake:
            raise RuntimeError(f"weights_digest: the fleet sleeps or moves to or from sleep (level {self.sleep.level}, "
                               f"replica(s) {', '.join(not_awake[:4]) or 'none'} not awake): wake() first")
        self.asks += 1
        self.ask, self.asked, self.got = f"{self.id_prefix}d{self.asks}", set(replicas), {}
        for rid in replicas:
            self.outbox.replace_control(rid, (DigestWeights,), DigestWeights(self.ask, detail))
        return self.ask

    def record(self, replica_id: str, answer) -> None:
        """A report's Report.digest: kept if it answers the latest ask."""
        if isinstance(answer, WeightsDigest) and answer.ask == self.ask and replica_id in self.asked:
            self.got[replica_id] = answer

    def forget(self, replica_id: str) -> None:
        """The replica left: nobody waits for its answer."""
        self.asked.discard(replica_id)
        self.got.pop(replica_id, None)

    def answers(self, ask: str) -> dict:
        """{"ask", "replicas": {replica_id: its answer as a dict}, "waiting": [replicas still to
        answer]}; an ask other than the latest is refused (its answers are gone)."""
        if ask != self.ask:
            raise KeyError(f"ask={ask!r}: not the latest weights digest asked ({self.ask!r}); ask again")
        return {"ask": ask, "replicas": {rid: asdict(a) for rid, a in sorted(self.got.items())},
                "waiting": sorted(self.asked.difference(self.got))}
