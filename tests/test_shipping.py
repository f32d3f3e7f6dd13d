"""What the documented launch paths ship to the cluster."""
import re
import shlex
from pathlib import Path

from rollout_cluster.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _readme_job_command() -> list:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "README.md").read_text())
    line = next(ln for ln in text.splitlines() if "ray job submit" in ln and "rollout_cluster.jobs.rollout" in ln)
    return shlex.split(line[line.index("ray job submit"):])


def test_the_readme_job_names_a_model_its_nodes_have():
    """README "Ray jobs and token auth": `ray job submit --working-dir . -- python -m
    rollout_cluster.jobs.rollout --config configs/local-cpu.yaml ...`. Ray packs the working dir
    honouring .gitignore, which ignores `models/`: in the job's copy the config's relative model
    path is not there (vLLM would get the bare string "models/tiny-llama"), so the command names
    the model by its absolute path on the head node (--model), unless Ray ships the config's."""
    from ray._private.runtime_env.packaging import get_excludes_from_ignore_files

    argv = _readme_job_command()
    assert argv[argv.index("--working-dir") + 1] == "."
    cfg = load_config(ROOT / argv[argv.index("--config") + 1])
    model = Path(cfg.engine.model)
    excludes = get_excludes_from_ignore_files(ROOT, include_gitignore=True)
    left_behind = not model.is_absolute() and any(e(p) for e in excludes for p in (ROOT / model.parts[0], ROOT / model))
    if left_behind:
        assert "--model" in argv, f"{cfg.engine.model} is not in the job's copy of the working dir, and no --model"
        given = argv[argv.index("--model") + 1]
        assert given.startswith("$PWD/") and Path(given.replace("$PWD", str(ROOT))) == ROOT / model, given


def test_the_documented_image_build_leaves_local_secrets_out():
    """k8s/README.md builds the image with `COPY --chown=ray:users . /app`; .dockerignore leaves
    out .venv, .whl, .git, models, bench-out, but not `.secrets/`, where RolloutClient.start, the
    demo and the Ray job write the local bearer token and HMAC control keys (security/local.py;
    .gitignore has /.secrets/). An image built from a checkout that ever ran the demo carries
    those secrets at /app/.secrets for everyone who can pull it."""
    patterns = [ln.strip().strip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert any(p in (".secrets", ".secrets/", ".secrets/*", "**/.secrets") for p in patterns), patterns
