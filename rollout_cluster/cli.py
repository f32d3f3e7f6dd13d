"""rollout-cluster: serve | generate | update-weights | weights-digest | sleep | wake | scale | make-model |
write-manifest | demo | bench | simulate | calibrate."""
from __future__ import annotations

import argparse
import json
import sys
import time

from .cli_types import at_least, fraction, seconds  # noqa: F401 (seconds, fraction: tests import them from here)


def cmd_make_model(a) -> int:
    from .model_maker import make_model, write_arch_config

    if a.arch:
        print(f"config of {a.arch} written to {write_arch_config(a.dir, a.arch)} (use load_format: dummy)")
        return 0
    path = make_model(a.dir, hidden=a.hidden, layers=a.layers, heads=a.heads, vocab=a.vocab,
                      intermediate=a.intermediate, seed=a.seed, dtype=a.dtype)
    print(f"model written to {path}")
    return 0


def cmd_write_manifest(a) -> int:
    from .engines.checkpoint import check_checkpoint, write_manifest

    path = write_manifest(a.dir, sha256=a.sha256)
    manifest = check_checkpoint(a.dir, require_manifest=True)
    print(f"{path}: {len(manifest['files'])} files, {sum(manifest['files'].values())} bytes"
          + (", with sha256" if a.sha256 else ""))
    return 0


def cmd_serve(a) -> int:
    from .client.client import RolloutClient
    from .config import load_config

    client = RolloutClient.start(load_config(a.config), address=a.address)  # a bad config refused before Ray
    print(json.dumps(client.status(), indent=1, default=str))
    print(f"app {client.app_name!r} is serving; attach with RolloutClient.connect(app_name={client.app_name!r}). Ctrl-C stops it.")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        client.shutdown()
    return 0


def cmd_generate(a) -> int:
    from .client.client import RolloutClient
    from .client.jsonl import check_paths, run_jsonl
    from .config import load_config

    check_paths(a.input, a.output)  # before a cluster starts, not after its batch ran
    if a.app_name:
        client = RolloutClient.connect(a.app_name, address=a.address or "auto")
    else:
        client = RolloutClient.start(load_config(a.config), address=a.address)  # a bad config refused before Ray
    try:
        summary = run_jsonl(client, a.input, a.output, progress=not a.quiet, timeout_s=a.timeout_s,
                            weights_version=a.weights_version, finish_fraction=a.finish_fraction,
                            finish_by=a.finish_by)
    finally:
        if not a.app_name:
            client.shutdown()
    print(json.dumps(summary))
    return 0


KEYS_HELP = ("the file of control keys that signs this order (default: $ROLLOUT_CONTROL_KEYS_FILE, "
             "else $ROLLOUT_CONTROL_KEYS; docs/security.md)")


def _attach(a):
    """Join the running app `a.app_name` at `a.address`, with Ray's worker logs off stdout (the
    attached commands print one JSON line)."""
    import ray

    from .client.client import RolloutClient

    ray.init(address=a.address, log_to_driver=False)
    return RolloutClient.connect(a.app_name, address=a.address, control_keys_file=a.control_keys_file)


def cmd_update_weights(a) -> int:
    client = _attach(a)
    t0 = time.monotonic()
    version = client.update_weights(a.path, a.version, timeout_s=a.timeout_s, running=a.running)
    print(json.dumps({"version": version, "path": a.path, "seconds": round(time.monotonic() - t0, 3),
                      "replicas": client.status()["weights"]["replicas"]}))
    return 0


def cmd_scale(a) -> int:
    """scale N: the engine fleet of a running app, in place (live batches continue)."""
    from .protocol import check_replicas
    from .protocol import InputError

    try:
        check_replicas(a.replicas)  # before connecting
    except InputError as e:
        print(e, file=sys.stderr)
        return 2
    client = _attach(a)
    t0 = time.monotonic()
    st = client.scale(a.replicas, timeout_s=a.timeout_s)
    print(json.dumps({"replicas": sorted(st["replicas"]), "expected_replicas": st["expected_replicas"],
                      "seconds": round(time.monotonic() - t0, 3)}))
    return 0


def cmd_sleep(a) -> int:
    """sleep --level N / wake: every engine of a running app, between batches (vLLM sleep mode)."""
    client = _attach(a)
    t0 = time.monotonic()
    st = client.sleep(a.level, timeout_s=a.timeout_s) if a.level else client.wake(timeout_s=a.timeout_s)
    print(json.dumps({"level": st["sleep"]["level"], "seconds": round(time.monotonic() - t0, 3),
                      "replicas": st["sleep"]["replicas"], "weights_version": st["weights"]["version"]}))
    return 0


def cmd_weights_digest(a) -> int:
    """weights-digest: every replica's weights version and digest; exit 1 when they differ."""
    client = _attach(a)
    got = client.weights_digest(timeout_s=a.timeout_s, detail=a.detail)
    same = len({(r["version"], r["digest"]) for r in got.values()}) <= 1
    print(json.dumps({"identical": same, "replicas": got}))
    return 0 if same else 1


def cmd_demo(a) -> int:
    from .demo import run_demo

    run_demo(a.config, a.prompts, a.samples, a.log_dir)
    return 0


def main(argv=None) -> int:
    from .model_maker import ARCHITECTURES

    ap = argparse.ArgumentParser(prog="rollout-cluster")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-model", help="write a small random-weight Llama to DIR")
    p.add_argument("dir")
    p.add_argument("--hidden", type=at_least(1), default=128)
    p.add_argument("--layers", type=at_least(1), default=2)
    p.add_argument("--heads", type=at_least(1), default=2)
    p.add_argument("--vocab", type=at_least(1), default=2048)
    p.add_argument("--intermediate", type=at_least(1), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--arch", default=None, choices=sorted(ARCHITECTURES), help="write only the config.json of a public "
                   "architecture for dummy weights")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("write-manifest", help="seal a finished checkpoint: write DIR/rollout-manifest.json last "
                       "(every file's size; docs/checkpoints.md)")
    p.add_argument("dir")
    p.add_argument("--sha256", action="store_true", help="record each file's sha256 too (the engines check it)")
    p.set_defaults(fn=cmd_write_manifest)

    p = sub.add_parser("serve", help="start a long-lived app (local Ray unless --address)")
    p.add_argument("config")
    p.add_argument("--address", default=None)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("generate", help="JSONL batch in, JSONL results out")
    p.add_argument("--config", required=False, help="start a local cluster with this config (not with --app-name)")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--address", default=None, help="Ray address; default: start a local cluster")
    p.add_argument("--app-name", default=None,
                   help="use an app that already runs (with its own config) instead of starting one")
    p.add_argument("--timeout-s", type=seconds, default=None)
    p.add_argument("--weights-version", type=at_least(0), default=None,
                   help="run only on this weights version (update-weights prints it); other weights refuse the batch")
    p.add_argument("--finish-fraction", type=fraction, default=None,
                   help="partial rollouts: cut the batch once this share of its sequences is done; the rest come back "
                        "with finish_reason abort and their tokens, to resume as output_token_ids lines")
    p.add_argument("--finish-by", default="sample", choices=("sample", "group"),
                   help="what --finish-fraction counts: samples, or lines whose every sample is done")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("update-weights", help="reload every replica of a running app from a checkpoint directory")
    p.add_argument("path", help="a save_pretrained() directory every replica's node can read")
    p.add_argument("--version", type=at_least(0), default=None, help="default: the current version + 1")
    p.add_argument("--app-name", default="rollout")
    p.add_argument("--address", default="auto")
    p.add_argument("--timeout-s", type=seconds, default=600.0)
    p.add_argument("--running", default="finish", choices=("finish", "keep", "recompute", "abort"),
                   help="what becomes of the sequences that run now (RolloutClient.update_weights)")
    p.add_argument("--control-keys-file", default=None, help=KEYS_HELP)
    p.set_defaults(fn=cmd_update_weights)

    for name, helptext in (("sleep", "put every engine of a running app to sleep between batches (vLLM sleep mode)"),
                           ("wake", "wake every engine of a running app (a level-2 sleeper reloads its weights)")):
        p = sub.add_parser(name, help=helptext)
        if name == "sleep":
            p.add_argument("--level", type=int, default=1, choices=(1, 2),
                           help="1: weights to host memory, KV cache dropped; 2: both dropped")
        p.add_argument("--app-name", default="rollout")
        p.add_argument("--address", default="auto")
        p.add_argument("--timeout-s", type=seconds, default=600.0)
        p.add_argument("--control-keys-file", default=None, help=KEYS_HELP)
        p.set_defaults(fn=cmd_sleep, level=p.get_default("level") or 0)

    p = sub.add_parser("scale", help="grow or shrink the engine fleet of a running app, in place")
    p.add_argument("replicas", type=int, help="the number of EngineReplicas to run")
    p.add_argument("--app-name", default="rollout")
    p.add_argument("--address", default="auto")
    p.add_argument("--timeout-s", type=seconds, default=600.0)
    p.add_argument("--control-keys-file", default=None, help=KEYS_HELP)
    p.set_defaults(fn=cmd_scale)

    p = sub.add_parser("weights-digest", help="each replica's weights version and a digest of its weights' bits "
                                              "(exit 1 when replicas differ)")
    p.add_argument("--detail", action="store_true", help="every parameter's digest, dtype and shape too")
    p.add_argument("--app-name", default="rollout")
    p.add_argument("--address", default="auto")
    p.add_argument("--timeout-s", type=seconds, default=120.0)
    p.add_argument("--control-keys-file", default=None, help=KEYS_HELP)
    p.set_defaults(fn=cmd_weights_digest)

    p = sub.add_parser("demo", help="local CPU cluster, one mixed-length batch, a summary")
    p.add_argument("--config", default="configs/local-cpu.yaml")
    p.add_argument("--prompts", type=at_least(1), default=16)
    p.add_argument("--samples", type=at_least(1), default=4)
    p.add_argument("--log-dir", default="logs", help="where the demo writes logs/demo-<time>.log (Ray, Serve, vLLM)")
    p.set_defaults(fn=cmd_demo)

    try:
        from .bench.cli import add_commands

        add_commands(sub)
    except ImportError:
        pass
    a = ap.parse_args(argv)
    if a.cmd == "generate" and not (a.config or a.app_name):
        ap.error("generate needs --config (start a cluster) or --app-name (use a running app)")
    if a.cmd == "generate" and a.config and a.app_name:
        # The running app was deployed with its own config: its engine, policy and sampling
        # defaults are the ones that count, so this one would have no effect. Refuse, not ignore.
        ap.error(f"generate takes --config {a.config} (start a cluster with it) or --app-name {a.app_name} "
                 "(use an app that runs, with the config it was deployed with), not both")
    return refusing(f"rollout-cluster {a.cmd}", a.fn, a)


def refusing(prog: str, fn, *args) -> int:
    """fn(*args), with a refusal of bad input (a config key, a request field, a limit: each names
    itself and its value) printed as one line and exit code 2, as argparse's are, not a traceback;
    a fleet that did not get there in time (TimeoutError: what the fleet is at, what stays ordered)
    one line and exit code 1."""
    from .bench.flags import FlagError
    from .config import ConfigError
    from .protocol import InputError, LimitExceeded

    try:
        return fn(*args)
    except (ConfigError, FlagError, InputError, LimitExceeded) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
