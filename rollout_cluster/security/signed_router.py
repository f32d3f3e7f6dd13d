"""The Router's Serve handle as its callers hold it: control calls go out signed.

`SignedRouter(handle, signer).update_weights.remote(path, version)` sends
`update_weights.remote(SignedOrder(...))`; every other method passes through unchanged. The
client, the CLI, the Gateway and the replicas hold one, so no call site builds orders itself.
"""
from __future__ import annotations

from .signing import CONTROL_OPS, Signer, bind_args


class SignedRouter:
    def __init__(self, handle, signer: Signer):
        self.handle, self.signer = handle, signer

    def __getattr__(self, name: str):
        method = getattr(self.handle, name)
        return _SignedMethod(method, name, self.signer) if name in CONTROL_OPS else method


class _SignedMethod:
    def __init__(self, method, op: str, signer: Signer):
        self.method, self.op, self.signer = method, op, signer

    def remote(self, *args, **kwargs):
        return self.method.remote(self.signer.sign(self.op, bind_args(self.op, args, kwargs)))

    def options(self, **options):
        return _SignedMethod(self.method.options(**options), self.op, self.signer)
