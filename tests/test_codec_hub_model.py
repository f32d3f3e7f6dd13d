"""A model named by its Hugging Face id (the shipped RayService's engine.model:
"Qwen/Qwen2.5-7B-Instruct") gets its tokenizer as vLLM's engines get the model: from the Hugging
Face cache under HF_HOME, fetched there if missing. Before, the Gateway looked only for a local
folder, so the RayService refused every text prompt and chat request (no tokenizer.json). Each case
runs in its own process with the environment a pod would have: huggingface_hub reads it at import."""
import json
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).absolute().parents[1]
TINY = ROOT / "models" / "tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

LOAD = """
import json, sys, yaml
from rollout_cluster.config import load_config
from rollout_cluster.text.codec import TextCodec
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
(svc,) = [d for d in docs if d.get("kind") == "RayService"]
(app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
cfg = load_config(app["args"])
codec = TextCodec.load(cfg.model_path())  # as the Gateway does (serve/gateway.py)
print(json.dumps({"model": cfg.engine.model, "ids": codec and codec.encode("Once upon"),
                  "template": bool(codec and codec.chat_template)}))
"""


def hub_cache(home: Path, repo: str) -> None:
    """The Hugging Face cache's layout for `repo` at one commit, holding tiny-llama's tokenizer."""
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, snapshot / name)


def load_in_pod(env: dict) -> tuple[dict, str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": env["HF_HOME"]}
    out = subprocess.run([sys.executable, "-c", LOAD, str(ROOT / "k8s" / "rayservice-a100x32.yaml")],
                         env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def expected_ids() -> list:
    from rollout_cluster.text.codec import TextCodec
    return TextCodec.load(str(TINY)).encode("Once upon")


def test_the_rayservices_hub_model_has_its_tokenizer_from_the_cache(tmp_path):
    hub_cache(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    got, _ = load_in_pod({"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert got["model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert got["ids"] == expected_ids() and len(got["ids"]) >= 2


def test_an_unreachable_hub_falls_back_to_the_cache(tmp_path):
    """Online mode whose Hub does not answer (a closed port): the cached files serve."""
    hub_cache(tmp_path, "Qwen/Qwen2.5-7B-Instruct")
    got, _ = load_in_pod({"HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "5"})
    assert got["ids"] == expected_ids()


def test_a_hub_model_with_no_tokenizer_anywhere_is_token_ids_only_and_says_why(tmp_path):
    got, log = load_in_pod({"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert got["ids"] is None
    assert "no tokenizer for engine.model='Qwen/Qwen2.5-7B-Instruct'" in log and "token ids work" in log


def test_a_local_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    """A relative folder that does not exist ("models/none") looks like "owner/name": it is still
    asked of the Hub only when nothing is at that path; a folder that is there is read as it is."""
    from rollout_cluster.text.codec import TextCodec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    shutil.copytree(TINY, tmp_path / "models" / "tiny", ignore=shutil.ignore_patterns("*.safetensors"))
    assert TextCodec.load("models/tiny").encode("Once upon") == expected_ids()
    assert TextCodec.load("/no/such/folder") is None  # (an absolute path is no hub id)
