"""Orders waiting for each replica's next pull.

The router never addresses a replica: it leaves orders here, and a replica's pull takes its own.
A give-up the policy decides for another replica, a load order, a sleep order wait until that
replica pulls (the Serve router wakes its held pull when something is left for it).
"""
from __future__ import annotations

from ..protocol import ControlOrder, Orders


class Outbox:
    def __init__(self):
        self.orders: dict[str, Orders] = {}  # replica_id -> orders not yet taken

    def __bool__(self) -> bool:
        return bool(self.orders)

    def __contains__(self, replica_id) -> bool:
        return replica_id in self.orders

    def __getitem__(self, replica_id: str) -> Orders:
        return self.orders[replica_id]

    def get(self, replica_id: str):
        return self.orders.get(replica_id)

    def replica_ids(self) -> list[str]:
        """Replicas with orders waiting."""
        return list(self.orders)

    def to(self, replica_id: str) -> Orders:
        """The orders waiting for `replica_id`, to add to."""
        return self.orders.setdefault(replica_id, Orders())

    def take(self, replica_id: str) -> Orders:
        """Everything waiting for `replica_id` (empty Orders if nothing), removed."""
        return self.orders.pop(replica_id, None) or Orders()

    def drop(self, replica_id: str) -> None:
        self.orders.pop(replica_id, None)

    def pending(self, replica_id: str, kinds: tuple) -> bool:
        """A control order of one of `kinds` waits for `replica_id`."""
        orders = self.orders.get(replica_id)
        return orders is not None and any(isinstance(order, kinds) for order in orders.control)

    def replace_control(self, replica_id: str, kinds: tuple, order: ControlOrder) -> None:
        """`order` instead of any waiting control order of `kinds` (the newest target wins)."""
        orders = self.to(replica_id)
        orders.control = [o for o in orders.control if not isinstance(o, kinds)] + [order]
