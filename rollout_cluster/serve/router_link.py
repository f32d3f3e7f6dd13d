"""A replica's line to the router: its pulls carry the credential the router gave it at
registration (Router.register, a signed order), and it registers again when the router does
not know it (a restarted router). The pull loop sees one awaitable `pull(report) -> Orders`;
a pull the router did not apply fails like any lost pull, so its deltas are sent again."""
from __future__ import annotations


class NotRegistered(RuntimeError):
    """The router did not apply the report: it does not know this replica's credential."""


class RouterLink:
    def __init__(self, router, replica_id: str, incarnation: str):
        self.router = router  # a SignedRouter over the Router's handle
        self.replica_id, self.incarnation = replica_id, incarnation
        self.credential = ""  # from the router that answered register() last
        self.registrations = 0  # how often this replica registered (a restarted router asks again)

    async def pull(self, report):
        if not self.credential:
            self.credential = await self.router.register.remote(self.replica_id, self.incarnation)
            self.registrations += 1
        report.credential = self.credential
        orders = await self.router.pull.remote(report)
        if orders.register:
            self.credential = ""
            raise NotRegistered("the router does not know this replica (it restarted): registering again")
        return orders
