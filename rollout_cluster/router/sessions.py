"""Session affinity: which replica ran a multi-turn session's latest turn.

An agent's turns share a growing prefix (turn k+1's prompt = turn k's prompt + response + a new
part). The replica that ran turn k holds that prefix in its prefix cache, so turn k+1 costs one
prefill of the new part there and of the whole context anywhere else. A request that carries a
session id (SequenceRequest.session) is queued with that replica as its `home`; the pull-based
policies give it to the home when the home has a free slot (policy/pull.py), and to anyone
otherwise. Work-stealing may still move it later, at the re-prefill price it weighs for any move.

Plain state: no clock, no I/O. Bounded: the least recently used session is forgotten first
(a forgotten session's next turn goes anywhere, as a new session would).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional


class SessionHomes:
    def __init__(self, max_sessions: int = 65536):
        self.max_sessions = max_sessions  # sessions remembered at most (LRU beyond)
        self.homes: "OrderedDict[str, str]" = OrderedDict()  # session id -> replica of its latest turn
        self.hits = 0  # turns queued with a home (it ran an earlier turn and is alive)
        self.misses = 0  # turns of a session with no live home (new, forgotten, or its replica gone)

    def home(self, session: Optional[str], alive) -> Optional[str]:
        """Where `session`'s previous turn ran, if that replica is in `alive`; counts hit or miss."""
        if session is None:
            return None
        rid = self.homes.get(session)
        if rid is not None and rid in alive:
            self.homes.move_to_end(session)
            self.hits += 1
            return rid
        self.misses += 1
        return None

    def record(self, session: Optional[str], replica_id: Optional[str]) -> None:
        """A turn of `session` ended on `replica_id`: its context is cached there now."""
        if session is None or replica_id is None:
            return
        self.homes[session] = replica_id
        self.homes.move_to_end(session)
        while len(self.homes) > self.max_sessions:
            self.homes.popitem(last=False)

    def status(self) -> dict:
        return {"sessions": len(self.homes), "homed_turns": self.hits, "unhomed_turns": self.misses}
