"""security/signing.py: a forged order is refused as OrderRefused and counted by reason, whatever its characters."""
import time

import pytest

from rollout_cluster.security.signing import OrderRefused, OrderVerifier, SignedOrder, Signer

KEYS = {"k1": b"s" * 40}


@pytest.mark.parametrize("key_id, reason", [("k1", "bad_signature"), ("nokey", "unknown_key")])
def test_a_signature_with_non_ascii_characters_is_refused_and_counted(key_id, reason):
    """hmac.compare_digest raises TypeError for a str with non-ASCII characters: such a forged order
    escaped as a TypeError, uncounted in status()'s control.refused and the refused metric."""
    good = Signer(KEYS).sign("cancel", {"batch_id": "b1"})
    forged = SignedOrder(good.op, good.args, good.issued_ms, good.nonce, key_id, "\u00e9" * 64)
    verifier = OrderVerifier(KEYS)
    with pytest.raises(OrderRefused) as refused:
        verifier.check(forged, "cancel", time.time())
    assert refused.value.reason == reason and verifier.refusals[reason] == 1
