"""The driver's side: RolloutClient (client.py) over one sans-I/O batch follower (follower.py)
with a sync and an async driver (loops.py, batches.py), request expansion (expand.py), starting
and joining the app (lifecycle.py), fleet operations (fleet_ops.py) and the JSONL formats (jsonl.py).

Nothing is imported here: the HTTP Gateway (serve/gateway.py) imports the follower and the
async loop without RolloutClient (which imports serve/ to deploy), so no import circle runs
through this package.
`from rollout_cluster import RolloutClient` is the public name."""
