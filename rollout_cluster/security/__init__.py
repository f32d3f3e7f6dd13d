"""Who may use the app: the HTTP token, signed control orders, replica credentials (docs/security.md).

- secrets.py reads the token and the control keys from where the config says they are;
- signing.py signs control orders (Signer) and checks them (OrderVerifier): pure, clock injected;
- nonce_journal.py keeps the accepted nonces in Ray's GCS, so a restarted router refuses replays too;
- signed_router.py wraps the Router's handle so that callers sign without knowing it.
"""
