"""Co-located trainer and engine on one GPU: push_weights(transport="ipc") against the checkpoint
path (save_pretrained + update_weights) and against push_weights through the object store.

This process is the trainer and the Ray driver: it starts a local cluster with one vLLM replica
on the GPU, builds the same architecture with transformers on the same GPU, and moves its weights
into the engine each way. Phases (each timed, printed as one JSON line at once, and kept in
OUT/colocated.json, which is rewritten after every phase; a failed phase is recorded and the
next one that does not depend on it still runs):
  a start the cluster; greedy batch A (vLLM's dummy weights)
  b the trainer's model: from_config, random init, on the GPU
  c sleep(level=1); the GPU's free memory awake and asleep; one in-place update of the trainer's
    parameters while the fleet sleeps; wake
  d push_weights(transport="ipc"), timed end to end; greedy batch B (must differ from A); the
    replica's weights digest (RolloutClient.weights_digest)
  e save_pretrained to local disk + write the manifest + update_weights; batch C (== B but near-ties);
    the digest again (== d's: the checkpoint holds the pushed bits)
  f push_weights(transport="object_store") of the same tensors; batch E (== B but near-ties)
  g the cluster down; a fresh vLLM LLM from e's checkpoint; batch D compared with B token by token,
    and B's tokens scored by the fresh engine (where D first differs from B, how far B's token was
    from the fresh engine's top one: a near-tie, or different logits); the fresh engine's weights digest (our worker extension's rc_weights_digest) against d's, and
    the first 20 parameters that differ

    python experiments/weights-colocated/run.py --size 7b --out $OUT        # one H200
    python experiments/weights-colocated/run.py --device cpu --out /tmp/c   # control flow on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = {"7b": "qwen2.5-7b", "1.5b": "qwen2.5-1.5b"}
GIB = 2 ** 30


class Run:
    """The phases' shared state and the report, written after each phase."""

    def __init__(self, out: Path, skip: set, budget_s: float):
        self.out, self.skip = out, skip  # where colocated.json goes; the phase letters not to run
        self.deadline = time.monotonic() + budget_s  # a phase that needs more than is left is skipped
        self.report: dict = {"phases": []}  # what every phase printed, in order, and the summary
        self.client = None  # the RolloutClient while the cluster runs
        self.model = None  # the trainer's transformers model
        self.batches: dict = {}  # batch name -> token id lists, one per prompt
        self.ckpt = ""  # e's checkpoint directory
        self.ckpt_root = ""  # the folder e saves under (the cluster's checkpoint root)
        self.digests: dict = {}  # batch name -> the weights digest taken after it ({"digest", "params", ...})

    def phase(self, name: str, fn, needs=(), min_left_s: float = 0.0) -> None:
        letter = name[0]
        missing = [n for n in needs if not n()]
        line = {"phase": name}
        left = self.deadline - time.monotonic()
        if letter in self.skip:
            line["skipped"] = "--skip"
        elif left < min_left_s:
            line["skipped"] = f"{left:.0f} s of --budget-s left, it needs {min_left_s:.0f}"
        elif missing:
            line["skipped"] = "an earlier phase it needs failed or was skipped"
        else:
            t0 = time.monotonic()
            try:
                line.update(fn() or {})
                line["ok"] = True
            except Exception as e:  # recorded; the next independent phase still runs
                line.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000],
                            trace=traceback.format_exc()[-3000:])
            line["phase_s"] = round(time.monotonic() - t0, 2)
        print(json.dumps(line), flush=True)
        self.report["phases"].append(line)
        self.save()

    def save(self) -> None:
        (self.out / "colocated.json").write_text(json.dumps(self.report, indent=1))


def compare(x: list, y: list) -> dict:
    """How many sequences are identical, and where the others first differ."""
    first = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
             for a, b in zip(x, y) if a != b]
    return {"identical": len(x) - len(first), "of": len(x), "first_diff_positions": first}


NEAR_TIE = 0.05  # nats: a first difference where the two top tokens are this close is bf16 noise, not weights


def tie_gaps(prompts: list, ref: list, other: list, scored: list) -> dict:
    """Where `other` (the fresh engine's greedy tokens) first differs from `ref` (the pushed
    engine's), how far ref's token was from the fresh engine's own top choice at that position,
    scored by the fresh engine on prompt + ref's tokens (prompt_logprobs): a near-tie is a gap
    of at most NEAR_TIE nats; a larger one says the engines compute different logits there."""
    gaps = []
    for p, r, o, s in zip(prompts, ref, other, scored):
        j = next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), None)
        if j is None:
            continue
        position = s.prompt_logprobs[len(p) + j]  # {token: Logprob} given prompt + r[:j] (= o[:j])
        top = max(lp.logprob for lp in position.values())
        gaps.append(round(top - position[r[j]].logprob, 4))
    return {"gaps_nats": gaps, "near_ties": sum(g <= NEAR_TIE for g in gaps), "threshold_nats": NEAR_TIE}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(ARCH), default="7b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: models/tiny-llama on vLLM-CPU, object_store instead of ipc, no sleep")
    ap.add_argument("--skip", default="", help="phase letters not to run, e.g. f,g")
    ap.add_argument("--no-object-store", action="store_true", help="skip phase f")
    ap.add_argument("--object-store-timeout", type=float, default=150.0)
    ap.add_argument("--store-repeats", default="",
                    help="after f, more object-store pushes of the same tensors, one per letter: s = through "
                         "the trainer's reused staging buffer (the default), f = each tensor into fresh memory "
                         "(ROLLOUT_PUSH_STAGING=0), t = staged and streamed (ROLLOUT_PUSH_STREAM=1: the order "
                         "goes out with the first bucket, the rest follow); each timed and its digest compared "
                         "with B's, e.g. f,s,f")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ckpt-dir", default=tempfile.gettempdir(), help="local disk for save_pretrained")
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--budget-s", type=float, default=540.0, help="f runs only with 240 s left, g with 100 s")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, set(a.skip.replace(",", "")) | ({"f"} if a.no_object_store else set()), a.budget_s)
    cuda = a.device == "cuda"
    run.report["args"] = vars(a)
    run.ckpt_root = tempfile.mkdtemp(prefix="colocated-", dir=a.ckpt_dir)
    run.report["ckpt_fs"] = subprocess.run(["df", "-T", run.ckpt_root], capture_output=True, text=True).stdout

    import torch

    from rollout_cluster.transfer.trace import mark  # ROLLOUT_PUSH_TRACE: breakdown.py's marks

    if cuda:
        model_dir = str(ROOT / "models" / ARCH[a.size])
        subprocess.run([sys.executable, "-m", "rollout_cluster.cli", "make-model", model_dir, "--arch", ARCH[a.size]],
                       check=True, cwd=ROOT)
        dtype, engine = "bfloat16", {"enable_sleep_mode": True, "gpu_memory_utilization": a.gpu_util}
    else:
        model_dir, dtype, engine = str(ROOT / "models" / "tiny-llama"), "float32", {"cpu_kv_cache_gib": 1}
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # g's LLM in this process
        if not os.path.isdir(model_dir):
            subprocess.run([sys.executable, "-m", "rollout_cluster.cli", "make-model", model_dir], check=True, cwd=ROOT)
    cfg = {"app_name": "colocated", "replicas": 1,
           "engine": {"kind": "vllm", "model": model_dir, "load_format": "dummy", "dtype": dtype,
                      "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 64,
                      "max_num_batched_tokens": 8192, **engine},
           "resources": {"num_cpus": 1, "num_gpus": 1 if cuda else 0},
           "router": {"replica_timeout_s": 120}, "policy": {"name": "pull"},
           "security": {"checkpoint_roots": [run.ckpt_root]}}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(8, 48))] for _ in range(a.prompts)]
    tdtype = getattr(torch, dtype)

    def free_gib() -> float:
        return round(torch.cuda.mem_get_info()[0] / GIB, 2) if cuda else -1.0

    def batch(name: str) -> dict:
        from rollout_cluster import SamplingSpec

        t0 = time.monotonic()
        done = run.client.generate(prompts, SamplingSpec(n=1, max_tokens=a.tokens, temperature=0.0, ignore_eos=True),
                                   timeout_s=300)
        run.batches[name] = [list(c.token_ids) for c in sorted(done, key=lambda c: c.prompt_index)]
        return {f"batch_{name}_s": round(time.monotonic() - t0, 2), f"batch_{name}_version": done[0].weights_version}

    def digest(name: str) -> dict:
        """The replica's weights digest after batch `name`, kept whole for g; a failure is recorded,
        the phase's own results stand."""
        t0 = time.monotonic()
        try:
            got = run.client.weights_digest(timeout_s=300, detail=True)
        except Exception as e:
            return {f"digest_{name}_error": f"{type(e).__name__}: {e}"[:500]}
        d = run.digests[name] = next(iter(got.values()))  # one replica
        return {f"digest_{name}": d["digest"], f"digest_{name}_version": d["version"],
                f"digest_{name}_s": round(time.monotonic() - t0, 2), f"digest_{name}_engine_s": d["seconds"]}

    def differing(a: dict, b: dict) -> dict:
        """Two digests compared: equal, and the parameters (first 20) whose digests differ or are in one only."""
        names = sorted(n for n in set(a["params"]) | set(b["params"])
                       if a["params"].get(n, {}).get("digest") != b["params"].get(n, {}).get("digest"))
        return {"equal": a["digest"] == b["digest"], "params_differ": len(names), "first_differ": names[:20]}

    def tensors() -> list:  # named_parameters: a tied lm_head once, as save_pretrained writes it
        return [(n, p.detach()) for n, p in run.model.named_parameters()]

    def start() -> dict:
        from rollout_cluster import RolloutClient

        info = {"free_gib_before_start": free_gib()}
        t0 = time.monotonic()
        run.client = RolloutClient.start(cfg, wait_ready_s=400)
        info.update(start_s=round(time.monotonic() - t0, 1), free_gib_after_start=free_gib(), **batch("A"))
        return info

    def build() -> dict:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(1)
        with torch.device(a.device):
            run.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=tdtype)
        run.model.eval()
        n = sum(p.numel() for p in run.model.parameters())
        return {"params": n, "bytes": n * tdtype.itemsize, "free_gib_after_build": free_gib()}

    def sleep_update_wake() -> dict:
        info = {"free_gib_awake": free_gib()}
        if cuda:
            t0 = time.monotonic()
            run.client.sleep(1)
            info.update(sleep_s=round(time.monotonic() - t0, 2), free_gib_asleep=free_gib())
        with torch.no_grad():  # an optimizer-like step while the engine sleeps
            for p in run.model.parameters():
                p.mul_(0.99)
        if cuda:
            torch.cuda.synchronize()
            t0 = time.monotonic()
            run.client.wake()
            info.update(wake_s=round(time.monotonic() - t0, 2), free_gib_woken=free_gib())
        return info

    def push(transport: str, name: str, timeout_s: float = 300.0) -> dict:
        way = "push" if transport == "object_store" else transport  # (breakdown.py's tables: object store)
        mark(f"{way}_start", round=0)  # ROLLOUT_PUSH_TRACE: every process's marks
        t0 = time.monotonic()
        v = run.client.push_weights(tensors(), transport=transport, timeout_s=timeout_s)
        mark(f"{way}_end", round=0)
        info = {f"push_{transport}_s": round(time.monotonic() - t0, 2), "version": v, "transport": transport}
        info["handed"] = run.client.status()["weights"].get("handed")  # how each replica's worker got them
        info.update(batch(name))
        info.update(digest(name))  # B: kept for g; any other: the same tensors, so B's digest
        if name != "B" and name in run.digests and "B" in run.digests:
            info[f"digest_{name}_vs_B"] = differing(run.digests["B"], run.digests[name])
        info[f"{name}_vs_A"] = compare(run.batches["A"], run.batches[name]) if "A" in run.batches else None
        if name != "B" and "B" in run.batches:
            info[f"{name}_vs_B"] = compare(run.batches["B"], run.batches[name])
        again = name + "2"  # the same batch once more on the same weights: what the engine itself repeats
        info.update(batch(again))
        info[f"{again}_vs_{name}"] = compare(run.batches[name], run.batches[again])
        return info

    def checkpoint() -> dict:
        from rollout_cluster.engines.checkpoint import write_manifest

        path = os.path.join(run.ckpt_root, "step1")
        mark("checkpoint_start", round=0)
        t0 = time.monotonic()
        run.model.save_pretrained(path, safe_serialization=True)
        save_s = time.monotonic() - t0
        t0 = time.monotonic()
        os.sync()  # on disk, as a trainer's checkpoint is before it names it (reported apart)
        sync_s = time.monotonic() - t0
        t0 = time.monotonic()
        write_manifest(path)
        manifest_s = time.monotonic() - t0
        mark("checkpoint_saved")  # (breakdown.py's save + manifest: with the os.sync here)
        t0 = time.monotonic()
        v = run.client.update_weights(path)
        mark("checkpoint_end", round=0)
        run.ckpt = path
        info = {"save_s": round(save_s, 2), "sync_s": round(sync_s, 2), "manifest_s": round(manifest_s, 3),
                "update_s": round(time.monotonic() - t0, 2), "version": v}
        info.update(batch("C"))
        if "B" in run.batches:
            info["C_vs_B"] = compare(run.batches["B"], run.batches["C"])
        info.update(digest("C"))
        if "B" in run.digests and "C" in run.digests:
            info["digest_C_vs_B"] = differing(run.digests["B"], run.digests["C"])
        return info

    def fresh_engine() -> dict:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from rollout_cluster.engines.weight_digest import merge_workers
        from rollout_cluster.engines.weight_keep import EXTENSION

        if run.client is not None:
            run.client.shutdown()
            run.client = None
        run.model = None
        if cuda:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            total, t0 = torch.cuda.mem_get_info()[1], time.monotonic()
            while torch.cuda.mem_get_info()[0] < 0.55 * total and time.monotonic() - t0 < 60:
                time.sleep(1)  # the replica's engine process exits after shutdown() returns
        free_before, t0 = free_gib(), time.monotonic()
        llm = LLM(model=run.ckpt, dtype=dtype, enforce_eager=True, max_model_len=4096, max_num_seqs=64,
                  max_num_batched_tokens=8192,  # the replica's limits
                  skip_tokenizer_init=True, worker_extension_cls=EXTENSION,  # rc_weights_digest
                  **({"gpu_memory_utilization": 0.5} if cuda else {}))
        info = {"llm_start_s": round(time.monotonic() - t0, 1), "free_gib_before_llm": free_before}
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True))
        run.batches["D"] = [list(o.outputs[0].token_ids) for o in outs]
        for other in ("B", "C"):
            if other in run.batches:
                info[f"D_vs_{other}"] = compare(run.batches[other], run.batches["D"])
        for other in ("B", "A"):  # scored by the fresh engine: B's differences near-ties? A's (other weights) calibrate
            if other in run.batches:
                scored = llm.generate([TokensPrompt(prompt_token_ids=p + b) for p, b in zip(prompts, run.batches[other])],
                                      SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
                info[f"D_vs_{other}_ties"] = tie_gaps(prompts, run.batches[other], run.batches["D"], scored)
        t0 = time.monotonic()
        run.digests["D"] = d = merge_workers(llm.collective_rpc("rc_weights_digest"), detail=True)
        info.update(digest_D=d["digest"], digest_D_s=round(time.monotonic() - t0, 2))
        if "B" in run.digests:
            info["digest_D_vs_B"] = differing(run.digests["B"], d)
        return info

    def store_repeats() -> dict:
        """--store-repeats: the object-store push again, alternating how the trainer stages."""
        rounds = []
        for k, letter in enumerate(a.store_repeats.replace(",", ""), start=1):
            if letter not in "fst":
                raise ValueError(f"--store-repeats={a.store_repeats}: {letter!r} is none of f, s, t")
            os.environ["ROLLOUT_PUSH_STAGING"] = "0" if letter == "f" else "1"
            os.environ["ROLLOUT_PUSH_STREAM"] = "1" if letter == "t" else "0"
            mark("push_start", round=k)
            t0 = time.monotonic()
            v = run.client.push_weights(tensors(), transport="object_store", timeout_s=a.object_store_timeout)
            took = time.monotonic() - t0
            mark("push_end", round=k)
            got = digest(f"R{k}")
            rounds.append({"round": k, "staging": "fresh" if letter == "f" else "staged", "streamed": letter == "t",
                           "s": round(took, 2),
                           "version": v, "digest_vs_B": differing(run.digests["B"], run.digests[f"R{k}"])
                           if f"R{k}" in run.digests and "B" in run.digests else got})
            print(json.dumps(rounds[-1]), flush=True)
        os.environ.pop("ROLLOUT_PUSH_STAGING", None)
        os.environ.pop("ROLLOUT_PUSH_STREAM", None)
        return {"store_repeats": rounds}

    have = {"cluster": lambda: run.client is not None, "model": lambda: run.model is not None,
            "ckpt": lambda: bool(run.ckpt)}
    first = "ipc" if cuda else "object_store"  # vLLM-CPU has no CUDA: its control flow only
    run.phase("a_start_and_batch_A", start)
    run.phase("b_trainer_model", build)
    run.phase("c_sleep_update_wake", sleep_update_wake, (have["cluster"], have["model"]))
    run.phase(f"d_push_{first}", lambda: push(first, "B"), (have["cluster"], have["model"]))
    run.phase("e_save_and_update_weights", checkpoint, (have["cluster"], have["model"]))
    run.phase("f_push_object_store", lambda: push("object_store", "E", a.object_store_timeout),
              (have["cluster"], have["model"]), min_left_s=240)
    if a.store_repeats:
        run.phase("f2_store_repeats", store_repeats, (have["cluster"], have["model"]), min_left_s=200)
    run.phase("g_fresh_llm_from_checkpoint", fresh_engine, (have["ckpt"],), min_left_s=100)
    if run.client is not None:
        run.client.shutdown()
    summary(run, first)
    shutil.rmtree(run.ckpt_root, ignore_errors=True)


def summary(run: Run, first: str) -> None:
    got = {k: v for line in run.report["phases"] for k, v in line.items()}
    push_s, save_s, update_s = got.get(f"push_{first}_s"), got.get("save_s"), got.get("update_s")
    base = save_s + got.get("manifest_s", 0) + update_s if save_s is not None and update_s is not None else None
    line = {"summary": True, f"push_{first}_s": push_s, "push_object_store_s": got.get("push_object_store_s"),
            "save_s": save_s, "sync_s": got.get("sync_s"), "manifest_s": got.get("manifest_s"), "update_s": update_s,
            "ratio_checkpoint_over_push": round(base / push_s, 2) if base and push_s else None,
            "free_gib_awake": got.get("free_gib_awake"), "free_gib_asleep": got.get("free_gib_asleep"),
            "B_vs_A": got.get("B_vs_A"), "C_vs_B": got.get("C_vs_B"), "E_vs_B": got.get("E_vs_B"),
            "D_vs_B": got.get("D_vs_B"), "D_vs_B_ties": got.get("D_vs_B_ties"),
            "D_vs_A_ties": got.get("D_vs_A_ties"), "digest_B": got.get("digest_B"), "digest_C_vs_B": got.get("digest_C_vs_B"),
            "digest_D_vs_B": got.get("digest_D_vs_B"),
            "failed": [p["phase"] for p in run.report["phases"] if p.get("ok") is False]}
    print(json.dumps(line), flush=True)
    run.report["summary"] = line
    run.save()


if __name__ == "__main__":
    main()
