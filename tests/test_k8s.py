"""The KubeRay manifests in k8s/ against KubeRay's own CRD schemas and against our config schema.

Every document in k8s/*.yaml is validated against the OpenAPI v3 schema of its kind: ray.io/v1
kinds from the KubeRay CRDs in tests/data/k8s-crds/ (its README names their commit), core kinds from
a small schema below. Unknown fields are refused, as `kubectl apply` (strict field validation)
does. Then the contents are checked: serveConfigV2 loads with `load_config`, mirrors
configs/a100x32.yaml and imports `rollout_cluster.serve.app.build`; the RayJob's entrypoint names
a real module and config; the worker groups hold enough GPUs and CPUs; token auth is on; the
Secret `rollout-secrets` is mounted as files in every Ray container and no secret value sits in a
manifest; the NetworkPolicy lets each kind of peer reach only its ports (tests/k8s_security.py).
The CRDs missing is a failure, never a skip.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from k8s_security import NETWORK_POLICY_SCHEMA, Endpoint, allows, containers, env_errors, secret_looking, strings

from rollout_cluster.config import ConfigError, load_config, to_dict

ROOT = Path(__file__).absolute().parents[1]
K8S = ROOT / "k8s"
CRD_DIR = Path(__file__).absolute().parent / "data" / "k8s-crds"
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayCluster": "ray.io_rayclusters.yaml"}
GPU = "nvidia.com/gpu"
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)  # KubeRay refuses authOptions below this rayVersion
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 60k lines: libyaml if there

# Core kinds that may sit beside the Ray resources: the fields we use, strictly.
PVC_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "PersistentVolumeClaim"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        "spec": {"type": "object", "required": ["accessModes", "resources"], "additionalProperties": False, "properties": {
            "accessModes": {"type": "array", "minItems": 1, "items": {
                "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
            "storageClassName": {"type": "string"}, "volumeMode": {"enum": ["Filesystem", "Block"]},
            "resources": {"type": "object", "additionalProperties": False, "required": ["requests"], "properties": {
                "requests": {"type": "object", "required": ["storage"],
                             "properties": {"storage": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$"}}}}}}},
    },
}
CORE_SCHEMAS = {("v1", "PersistentVolumeClaim"): PVC_SCHEMA,
                ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY_SCHEMA}


# ---- schema loading -----------------------------------------------------------------------------
def strict(node):
    """The CRD schema as the API server applies it: unknown fields refused (no pruning), nullable
    honoured, int-or-string spelled out. jsonschema ignores the x-kubernetes-* keywords."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: strict(v) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(node.get("type"), str):
        node["type"] = [node["type"], "null"]
    if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
    return node


_validators: dict = {}


def validator_for(api_version: str, kind: str):
    key = (api_version, kind)
    if key not in _validators:
        if key in CORE_SCHEMAS:
            schema = CORE_SCHEMAS[key]
        elif api_version == "ray.io/v1" and kind in CRD_FILES:
            crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=LOADER)
            assert crd["spec"]["names"]["kind"] == kind
            v1 = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            assert len(v1) == 1, f"{CRD_FILES[kind]} has no single v1 version"
            schema = strict(v1[0]["schema"]["openAPIV3Schema"])
        else:
            raise AssertionError(f"no schema for apiVersion={api_version} kind={kind}: add one to tests/test_k8s.py")
        jsonschema.Draft7Validator.check_schema(schema)
        _validators[key] = jsonschema.Draft7Validator(schema)
    return _validators[key]


def schema_errors(doc: dict) -> list:
    v = validator_for(doc.get("apiVersion"), doc.get("kind"))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(v.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


# ---- manifests ----------------------------------------------------------------------------------
def manifest_files() -> list:
    return sorted(K8S.glob("*.yaml"))


def documents() -> list:
    """(id, doc) for every non-empty YAML document in k8s/*.yaml."""
    out = []
    for path in manifest_files():
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            out.append((f"{path.name}#{i}", doc))
    return out


DOCS = documents()
RAY_DOCS = [(i, d) for i, d in DOCS if d.get("apiVersion") == "ray.io/v1"]


def by_kind(kind: str) -> list:
    return [d for _, d in RAY_DOCS if d["kind"] == kind]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]["rayClusterSpec"]


def serve_apps(doc: dict) -> list:
    return yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]


def job_config_path(doc: dict) -> Path:
    argv = shlex.split(doc["spec"]["entrypoint"])
    return ROOT / argv[argv.index("--config") + 1]


def quantity(q) -> float:
    """A Kubernetes CPU or count quantity ("64", 8, "500m") as a number."""
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def cluster_errors(spec: dict, cfg) -> list:
    """What keeps this cluster from hosting `cfg`: GPUs, CPUs, /dev/shm, head without GPUs."""
    errs = []
    from rollout_cluster.serve.app import replica_gpus

    tp, gpus_per_replica = cfg.engine.tensor_parallel_size, replica_gpus(cfg)
    need_gpus = cfg.replicas * gpus_per_replica
    head = spec["headGroupSpec"]
    if head.get("rayStartParams", {}).get("num-gpus") != "0":
        errs.append("head rayStartParams num-gpus must be \"0\": replicas belong on the GPU workers")
    have_gpus = 0.0
    for g in spec.get("workerGroupSpecs", []):
        pods = g.get("replicas", 0) * g.get("numOfHosts", 1)
        ray_c = g["template"]["spec"]["containers"][0]
        limits = ray_c.get("resources", {}).get("limits", {})
        per_pod = quantity(limits.get(GPU, 0))
        declared = g.get("rayStartParams", {}).get("num-gpus")
        if declared is not None and quantity(declared) != per_pod:
            errs.append(f"group {g['groupName']}: num-gpus {declared} != {GPU} limit {per_pod:g}")
        if g.get("minReplicas", 0) > g.get("replicas", 0) or g.get("replicas", 0) > g.get("maxReplicas", 0):
            errs.append(f"group {g['groupName']}: replicas outside [minReplicas, maxReplicas]")
        if per_pod and gpus_per_replica:
            fits = per_pod // gpus_per_replica  # a replica's GPUs are one actor's: all in one pod
            have_gpus += pods * fits * gpus_per_replica
            if fits * cfg.resources.num_cpus > quantity(limits.get("cpu", 0)):
                errs.append(f"group {g['groupName']}: {fits:g} replicas x {cfg.resources.num_cpus:g} CPUs "
                            f"exceed the pod's cpu limit {limits.get('cpu')}")
        shm = {v["name"] for v in g["template"]["spec"].get("volumes", [])
               if v.get("emptyDir", {}).get("medium") == "Memory"}
        if not any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in ray_c.get("volumeMounts", [])):
            errs.append(f"group {g['groupName']}: no memory-backed emptyDir mounted at /dev/shm")
    if have_gpus < need_gpus:
        errs.append(f"worker groups hold {have_gpus:g} GPUs; the config needs {need_gpus:g} "
                    f"(replicas={cfg.replicas} x {gpus_per_replica:g} GPUs each, tensor_parallel_size={tp})")
    return errs


DEPLOYMENTS = {"Router", "EngineReplica", "Gateway"}  # what rollout_cluster.serve.app builds


def engine_replicas(app: dict) -> int:
    """The engine fleet's size: EngineReplica's num_replicas under `deployments:` (how the fleet
    is scaled in place), else the builder's, args.replicas."""
    for d in app.get("deployments", []):
        if d.get("name") == "EngineReplica" and "num_replicas" in d:
            return d["num_replicas"]
    return load_config(app["args"]).replicas


def deployment_errors(app: dict) -> list:
    """Overrides under `deployments:` that Serve would refuse, or that would break the router."""
    errs = []
    for d in app.get("deployments", []):
        if d.get("name") not in DEPLOYMENTS:
            errs.append(f"deployments: {d.get('name')!r} is not one of {sorted(DEPLOYMENTS)}")
        if d.get("name") == "Router" and d.get("num_replicas", 1) != 1:
            errs.append(f"deployments: Router num_replicas={d['num_replicas']}: the router owns every "
                        "sequence's state and must be a single replica")
        if d.get("name") == "EngineReplica" and "autoscaling_config" in d and "num_replicas" in d:
            errs.append("deployments: EngineReplica sets both num_replicas and autoscaling_config")
    return errs


def pinned_ray_version() -> str:
    m = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml no longer pins ray[serve]==X"
    return m.group(1)


# ---- tests: the schemas themselves ---------------------------------------------------------------
def test_crds_are_present():
    missing = [f for f in CRD_FILES.values() if not (CRD_DIR / f).is_file()]
    assert not missing, (f"KubeRay CRDs missing from {CRD_DIR}: {missing}. They are test data in the repository "
                         "(tests/data/k8s-crds/README.md says where they come from).")


def test_manifests_exist():
    names = {p.name for p in manifest_files()}
    assert {"rayservice-a100x32.yaml", "rayjob-rollout.yaml"} <= names
    assert by_kind("RayService") and by_kind("RayJob")


@pytest.mark.parametrize("doc_id, doc", DOCS, ids=[i for i, _ in DOCS])
def test_manifest_matches_schema(doc_id, doc):
    errors = schema_errors(doc)
    assert not errors, f"{doc_id}:\n  " + "\n  ".join(errors[:20])


# ---- tests: negative cases, so the checks above can fail ---------------------------------------
def _service() -> dict:
    return copy.deepcopy(by_kind("RayService")[0])


def test_wrong_type_fails_schema():
    doc = _service()
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "four"
    errors = schema_errors(doc)
    assert any("workerGroupSpecs.0.replicas" in e and "'four' is not of type 'integer'" in e for e in errors), errors


def test_unknown_field_fails_schema():
    doc = _service()
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 4
    assert any("'replica' was unexpected" in e for e in schema_errors(doc))


def test_missing_required_field_fails_schema():
    doc = _service()
    del doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]
    assert any("'template' is a required property" in e for e in schema_errors(doc))


def test_bad_enum_fails_schema():
    doc = _service()
    doc["spec"]["rayClusterConfig"]["authOptions"]["mode"] = "password"
    assert any("authOptions.mode" in e for e in schema_errors(doc))


def test_drifted_serve_args_fail_config():
    args = copy.deepcopy(serve_apps(_service())[0]["args"])
    args["engine"]["max_num_seq"] = 256
    with pytest.raises(ConfigError, match="engine.max_num_seq: unknown key"):
        load_config(args)


def test_bad_deployment_overrides_fail():
    app = copy.deepcopy(serve_apps(_service())[0])
    app["deployments"] = [{"name": "EngineReplicas", "num_replicas": 8}, {"name": "Router", "num_replicas": 2}]
    errs = deployment_errors(app)
    assert any("'EngineReplicas' is not one of" in e for e in errs)
    assert any("Router num_replicas=2" in e for e in errs)


def test_scaling_past_the_gpus_fails():
    doc = _service()
    app = serve_apps(doc)[0]
    app["deployments"] = [{"name": "EngineReplica", "num_replicas": 40}]
    cfg = load_config(app["args"]).model_copy(update={"replicas": engine_replicas(app)})
    assert any("hold 32 GPUs; the config needs 40" in e for e in cluster_errors(cluster_spec(doc), cfg))


def test_too_few_gpus_fails():
    doc = _service()
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = 3
    cfg = load_config(serve_apps(doc)[0]["args"])
    assert any("hold 24 GPUs; the config needs 32" in e for e in cluster_errors(cluster_spec(doc), cfg))


@pytest.mark.parametrize("tp, replicas, enough", [(2, 16, True), (2, 17, False), (3, 8, True), (3, 9, False),
                                                  (16, 1, False)])
def test_tensor_parallel_replicas_must_fit_in_one_pod(tp, replicas, enough):
    """4 pods x 8 GPUs: tp 2 fits 16 replicas; tp 3 only 2 a pod (8 of them; 8 GPUs stranded);
    tp 16 none, as a replica's GPUs belong to one actor on one node."""
    doc = _service()
    cfg = load_config(serve_apps(doc)[0]["args"]).model_copy(update={"replicas": replicas})
    cfg.engine = cfg.engine.model_copy(update={"tensor_parallel_size": tp})
    short = [e for e in cluster_errors(cluster_spec(doc), cfg) if "the config needs" in e]
    assert (short == []) == enough, short


# ---- tests: contents ------------------------------------------------------------------------------
@pytest.mark.parametrize("doc_id, doc", RAY_DOCS, ids=[i for i, _ in RAY_DOCS])
def test_token_auth_and_ray_version(doc_id, doc):
    spec = cluster_spec(doc)
    assert spec.get("authOptions", {}).get("mode") == "token", f"{doc_id}: token auth must be on"
    assert spec["authOptions"].get("secretName"), f"{doc_id}: name the token Secret (stable across clusters)"
    assert spec["rayVersion"] == pinned_ray_version(), f"{doc_id}: rayVersion != the ray pinned in pyproject.toml"
    assert tuple(map(int, spec["rayVersion"].split("."))) >= MIN_RAY_FOR_TOKEN_AUTH


def test_serve_config_loads_and_mirrors_a100x32():
    (doc,) = by_kind("RayService")
    conf = yaml.safe_load(doc["spec"]["serveConfigV2"])
    assert isinstance(conf, dict) and conf["applications"], "serveConfigV2 must parse to a mapping with applications"
    (app,) = conf["applications"]
    assert app["name"] == "rollout"
    cfg = load_config(app["args"])
    assert cfg.app_name == app["name"], "args.app_name must equal the application's name: drivers use it"
    assert app.get("route_prefix") == f"/{cfg.app_name}"
    shipped = to_dict(load_config(ROOT / "configs" / "a100x32.yaml"))
    mine = to_dict(cfg)
    shipped["base_dir"] = mine["base_dir"] = ""
    assert mine == shipped, "serveConfigV2 args drifted from configs/a100x32.yaml"
    assert (cfg.replicas, cfg.resources.num_gpus, cfg.engine.max_num_seqs, cfg.engine.max_num_batched_tokens,
            cfg.policy.name, cfg.metrics.port) == (32, 1, 256, 16384, "steal", 9464)


def test_serve_config_passes_serves_own_schema_with_the_external_scaler_on():
    """What the operator PUTs to the dashboard: Serve's schema must take it, and the app must let
    RolloutClient.scale set num_replicas."""
    from ray.serve.schema import ServeDeploySchema

    services = by_kind("RayService")
    assert services
    for doc in services:
        conf = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
        assert all(app.external_scaler_enabled for app in conf.applications)


def test_import_path_resolves_to_build():
    from rollout_cluster.serve import app as app_module

    for doc in by_kind("RayService"):
        for app in serve_apps(doc):
            path = app["import_path"]
            module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
            assert getattr(importlib.import_module(module), attr) is app_module.build


def test_rayservice_cluster_fits_its_config():
    for doc in by_kind("RayService"):
        for app in serve_apps(doc):
            cfg = load_config(app["args"]).model_copy(update={"replicas": engine_replicas(app)})
            assert cluster_errors(cluster_spec(doc), cfg) == []


def test_engine_fleet_is_scaled_in_place():
    """The RayService names EngineReplica's num_replicas under `deployments:` (an edit there scales
    in place; an edit to args restarts the app), equal to args.replicas, the router's initial count."""
    for doc in by_kind("RayService"):
        for app in serve_apps(doc):
            assert deployment_errors(app) == []
            assert any(d["name"] == "EngineReplica" and "num_replicas" in d for d in app.get("deployments", []))
            assert engine_replicas(app) == load_config(app["args"]).replicas


def test_rayjob_runs_the_rollout_job():
    for doc in by_kind("RayJob"):
        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[:3] == ["python", "-m", "rollout_cluster.jobs.rollout"]
        assert importlib.util.find_spec(argv[2]) is not None
        opts = dict(zip(argv[3::2], argv[4::2]))
        assert opts == {"--config": "configs/a100x32.yaml", "--input": "/data/prompts.jsonl",
                        "--output": "/data/results.jsonl", "--ready-timeout-s": "1800"}
        # 32 engines download a 7B model and start (154 s on an H200 alone): the default 600 s
        # wait for readiness would fail the job and, with backoffLimit 0, the batch
        assert float(opts["--ready-timeout-s"]) >= 1200
        assert doc["spec"]["shutdownAfterJobFinishes"] is True
        cfg = load_config(job_config_path(doc))
        assert cluster_errors(cluster_spec(doc), cfg) == []
        head = cluster_spec(doc)["headGroupSpec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in head["containers"][0].get("volumeMounts", [])}
        assert "/data" in mounts, "the job's driver runs on the head: it must mount /data"
        vol = next(v for v in head["volumes"] if v["name"] == mounts["/data"])
        claim = vol["persistentVolumeClaim"]["claimName"]
        assert any(d.get("kind") == "PersistentVolumeClaim" and d["metadata"]["name"] == claim for _, d in DOCS), \
            f"no PersistentVolumeClaim {claim!r} in k8s/"


def test_both_clusters_have_the_same_layout():
    """The RayJob's cluster is the RayService's: a change to one should reach the other."""
    (svc,), (job,) = by_kind("RayService"), by_kind("RayJob")
    strip = lambda s: {k: v for k, v in s.items() if k != "headGroupSpec"}  # noqa: E731
    assert strip(cluster_spec(svc)) == strip(cluster_spec(job))


def test_every_engine_pod_reads_the_checkpoints_claim():
    """update_weights(path) needs the path on every replica's node: each GPU worker group mounts
    one ReadWriteMany claim at /checkpoints (the trainer writes it), read-only."""
    claims = {d["metadata"]["name"]: d for _, d in DOCS if d.get("kind") == "PersistentVolumeClaim"}
    for doc in by_kind("RayService") + by_kind("RayJob"):
        for group in cluster_spec(doc)["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            mounts = {m["mountPath"]: m for m in pod["containers"][0].get("volumeMounts", [])}
            assert "/checkpoints" in mounts, f"{doc['metadata']['name']}/{group['groupName']}: no /checkpoints"
            assert mounts["/checkpoints"].get("readOnly") is True
            vol = next(v for v in pod["volumes"] if v["name"] == mounts["/checkpoints"]["name"])
            claim = vol["persistentVolumeClaim"]["claimName"]
            assert claim in claims, f"no PersistentVolumeClaim {claim!r} in k8s/"
            assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]


# ---- tests: secrets --------------------------------------------------------------------------------
SECRET_NAME = "rollout-secrets"  # k8s/README.md: kubectl create secret generic rollout-secrets ...
SECRET_KEYS = {"token": "token_file", "control-keys": "control_keys_file"}  # Secret key -> security field
RAY_POD_LABEL = {"app.kubernetes.io/name": "rollout-cluster"}


def doc_config(doc: dict):
    """The cluster config the processes of this RayService or RayJob load."""
    if doc["kind"] == "RayService":
        (app,) = serve_apps(doc)
        return load_config(app["args"])
    return load_config(job_config_path(doc))


def ray_pods(doc: dict) -> list:
    """(name, pod template) of the head and of every worker group."""
    spec = cluster_spec(doc)
    return [("head", spec["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]


def secret_mount_errors(doc: dict, cfg) -> list:
    """What keeps a Ray container (the Router, the Gateway or a replica may run in any) from
    reading the token and the control keys where cfg.security names them."""
    errs, sec = [], cfg.security
    folders = {str(Path(getattr(sec, f)).parent) for f in SECRET_KEYS.values()}
    if len(folders) != 1 or "" in {getattr(sec, f) for f in SECRET_KEYS.values()}:
        return [f"security.token_file / control_keys_file must name two files of one mounted folder: {sorted(folders)}"]
    (folder,) = folders
    for name, template in ray_pods(doc):
        where, pod = f"{doc['metadata']['name']}/{name}", template["spec"]
        ray_c = pod["containers"][0]  # KubeRay's Ray container is the first one
        mounts = [m for m in ray_c.get("volumeMounts", []) if m["mountPath"] == folder]
        if len(mounts) != 1:
            errs.append(f"{where}: the Ray container mounts nothing at {folder}")
            continue
        (mount,) = mounts
        if mount.get("readOnly") is not True or "subPath" in mount:  # a subPath mount never sees a rotation
            errs.append(f"{where}: {folder} must be mounted readOnly, without subPath")
        vol = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
        secret = vol.get("secret", {})
        if secret.get("secretName") != SECRET_NAME:
            errs.append(f"{where}: {folder} is not the Secret {SECRET_NAME!r}")
            continue
        if secret.get("defaultMode") != 0o400 or secret.get("optional"):
            errs.append(f"{where}: the Secret volume needs defaultMode 0400 and must not be optional")
        items = {i["key"]: i["path"] for i in secret.get("items", [])}
        want = {key: Path(getattr(sec, f)).name for key, f in SECRET_KEYS.items()}
        if items != want:
            errs.append(f"{where}: Secret items {items} != {want} (the files security names)")
        if not pod.get("securityContext", {}).get("fsGroup"):
            errs.append(f"{where}: no fsGroup: files mode 0400 owned by root are unreadable to the image's `ray` user")
    return errs


@pytest.mark.parametrize("doc_id, doc", RAY_DOCS, ids=[i for i, _ in RAY_DOCS])
def test_secret_is_mounted_in_every_ray_container(doc_id, doc):
    assert secret_mount_errors(doc, doc_config(doc)) == []


def test_a_missing_secret_mount_fails():
    doc = _service()
    worker = cluster_spec(doc)["workerGroupSpecs"][0]["template"]["spec"]
    worker["containers"][0]["volumeMounts"] = [m for m in worker["containers"][0]["volumeMounts"]
                                               if m["name"] != "rollout-secrets"]
    head = cluster_spec(doc)["headGroupSpec"]["template"]["spec"]
    next(v for v in head["volumes"] if v["name"] == "rollout-secrets")["secret"]["defaultMode"] = 0o644
    errs = secret_mount_errors(doc, doc_config(doc))
    assert any("rollout/a100x8: the Ray container mounts nothing at /etc/rollout-secrets" in e for e in errs), errs
    assert any("rollout/head: the Secret volume needs defaultMode 0400" in e for e in errs), errs


@pytest.mark.parametrize("doc_id, doc", RAY_DOCS, ids=[i for i, _ in RAY_DOCS])
def test_security_config_names_files_and_the_checkpoint_claim(doc_id, doc):
    """Secrets are files, nothing is left open, and update_weights loads only from the claim that
    every Ray pod mounts read-only (the Router checks the path with realpath where it runs)."""
    sec = doc_config(doc).security
    assert not sec.allow_unauthenticated and not sec.allow_unsigned_control and sec.require_manifest
    assert sec.checkpoint_roots == ["/checkpoints"]
    for name, template in ray_pods(doc):
        mounts = {m["mountPath"]: m for m in template["spec"]["containers"][0].get("volumeMounts", [])}
        assert mounts.get("/checkpoints", {}).get("readOnly") is True, f"{doc_id}/{name}: no read-only /checkpoints"


def manifest_secret_errors(docs: list) -> list:
    """Secret-looking strings anywhere in the manifests (serveConfigV2, runtimeEnvYAML, args,
    entrypoint, env), and our secrets or secret-named literals in any container's env."""
    errs = []
    secret_vars = {f.default for f in
                   (type(load_config(ROOT / "configs" / "a100x32.yaml").security).model_fields[n]
                    for n in ("token_env", "control_keys_env"))}
    for doc_id, doc in docs:
        errs += [f"{doc_id}: {s!r} looks like a secret" for text in strings(doc) for s in secret_looking(text)]
        if doc.get("apiVersion") == "ray.io/v1":
            for name, template in ray_pods(doc):
                for c in containers(template["spec"]):
                    errs += env_errors(f"{doc_id}/{name}/{c['name']}", c, secret_vars)
    return errs


def test_no_secret_values_in_manifests_or_config():
    docs = DOCS + [("configs/a100x32.yaml", yaml.safe_load((ROOT / "configs" / "a100x32.yaml").read_text()))]
    assert manifest_secret_errors(docs) == []


@pytest.mark.parametrize("plant", ["serve_args", "runtime_env", "env_literal", "env_secret_ref", "rayjob_entrypoint"])
def test_a_planted_secret_is_found(plant):
    """A token in serveConfigV2, the app's runtime_env, a container's env (even from a
    secretKeyRef: ours are files) or the RayJob's entrypoint is reported."""
    # fixed values (a random one could lack digits): the test must not flake
    token, key = "Zt8mQ2vX9kPd-Lr4Wn7Hs_Jc3Bf6Ya1E", "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
    svc, job = _service(), copy.deepcopy(by_kind("RayJob")[0])
    conf = yaml.safe_load(svc["spec"]["serveConfigV2"])
    worker = cluster_spec(svc)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    if plant == "serve_args":
        conf["applications"][0]["args"]["security"]["token_env"] = token
    elif plant == "runtime_env":
        conf["applications"][0]["runtime_env"] = {"env_vars": {"ROLLOUT_CONTROL_KEYS": f"k1 {key}"}}
    elif plant == "env_literal":
        worker["env"].append({"name": "HF_TOKEN", "value": "see-the-hub"})
    elif plant == "env_secret_ref":
        ref = {"secretKeyRef": {"name": SECRET_NAME, "key": "token"}}
        worker["env"].append({"name": "ROLLOUT_TOKEN", "valueFrom": ref})
    else:
        job["spec"]["entrypoint"] += f" --token {token}"
    svc["spec"]["serveConfigV2"] = yaml.safe_dump(conf)
    errs = manifest_secret_errors([("svc", svc), ("job", job)])
    expected = {"serve_args": token, "runtime_env": key, "env_literal": "env HF_TOKEN holds a literal value",
                "env_secret_ref": "env ROLLOUT_TOKEN: our secrets are mounted files", "rayjob_entrypoint": token}[plant]
    assert any(expected in e for e in errs), errs


# ---- tests: network policy ------------------------------------------------------------------------
def network_policy() -> dict:
    (policy,) = [d for _, d in DOCS if d.get("kind") == "NetworkPolicy"]
    return policy


OPERATOR_NS = {"kubernetes.io/metadata.name": "default"}  # KubeRay's Helm chart default (networkpolicy.yaml: EDIT)
ALL_PORTS = (6379, 8000, 8080, 8265, 9464, 10001, 52365, 40123, 10002, 19999)  # GCS ... random raylet, workers
TRAINER, TRAINERS_NS = {"rollout-cluster/trainer": "true"}, {"rollout-cluster/trainers": "true"}
OPERATOR = {"app.kubernetes.io/name": "kuberay-operator"}
SUBMITTER = {"ray.io/originated-from-crd": "RayJob", "ray.io/originated-from-cr-name": "rollout-batch",
             "app.kubernetes.io/created-by": "kuberay-operator"}  # KubeRay's labels on the RayJob's submitter pod
PEERS = [  # who, and the ingress ports the policy must open to it (all others closed)
    (Endpoint("ray pod", {**RAY_POD_LABEL, "ray.io/node-type": "worker"}), set(ALL_PORTS)),
    (Endpoint("trainer", TRAINER), {8000}),
    (Endpoint("trainer, labelled namespace", TRAINER, TRAINERS_NS, same_ns=False), {8000}),
    (Endpoint("trainer, unlabelled namespace", TRAINER, {}, same_ns=False), set()),
    (Endpoint("unlabelled pod in the namespace", {"app": "other-team"}), set()),
    (Endpoint("unlabelled pod, labelled namespace", {"app": "x"}, TRAINERS_NS, same_ns=False), set()),
    (Endpoint("admin", {"rollout-cluster/admin": "true"}), {8265}),
    (Endpoint("RayJob submitter", SUBMITTER), {8265}),
    (Endpoint("KubeRay operator", OPERATOR, OPERATOR_NS, same_ns=False), {8000, 8265}),
    (Endpoint("operator label, another namespace", OPERATOR, {"kubernetes.io/metadata.name": "team-b"},
              same_ns=False), set()),
    (Endpoint("prometheus", {"app.kubernetes.io/name": "prometheus"}, {"kubernetes.io/metadata.name": "monitoring"},
              same_ns=False), {8080, 9464}),
    (Endpoint("internet", None, ip="203.0.113.7"), set()),
]


def policy_errors(policy: dict) -> list:
    """Every (peer, port) the policy opens or closes against PEERS, plus: it selects every Ray
    pod of both manifests, and isolates both directions."""
    errs = []
    spec = policy["spec"]
    for doc in by_kind("RayService") + by_kind("RayJob"):
        for name, template in ray_pods(doc):
            if not selects_pod(spec["podSelector"], template["metadata"].get("labels", {})):
                errs.append(f"{doc['metadata']['name']}/{name}: its pods are not selected by the policy")
    if set(spec.get("policyTypes", [])) != {"Ingress", "Egress"}:
        errs.append(f"policyTypes {spec.get('policyTypes')}: must isolate Ingress and Egress")
    for peer, open_ports in PEERS:
        for port in ALL_PORTS:
            if allows(policy, "ingress", peer, port) != (port in open_ports):
                errs.append(f"ingress from {peer.name} to {port}: {'open' if port not in open_ports else 'closed'}")
    return errs


def selects_pod(selector: dict, labels: dict) -> bool:
    return allows({"spec": {"policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": selector}]}]}},
                  "ingress", Endpoint("pod", labels), 1)


def test_network_policy_opens_each_port_to_its_peers_only():
    assert policy_errors(network_policy()) == []


def test_network_policy_egress():
    policy = network_policy()
    dns = Endpoint("kube-dns", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"}, same_ns=False)
    assert allows(policy, "egress", dns, 53, "UDP") and allows(policy, "egress", dns, 53, "TCP")
    assert allows(policy, "egress", Endpoint("ray pod", dict(RAY_POD_LABEL)), 6379)
    assert allows(policy, "egress", Endpoint("hub", None, ip="18.244.28.10"), 443)  # huggingface.co
    assert not allows(policy, "egress", Endpoint("hub", None, ip="18.244.28.10"), 80)
    assert not allows(policy, "egress", Endpoint("in-cluster service", None, ip="10.96.0.1"), 443)
    assert not allows(policy, "egress", Endpoint("other pod", {"app": "db"}), 5432)
    assert not allows(policy, "egress", dns, 8080)


@pytest.mark.parametrize("breach", ["allow_all_rule", "any_namespace_on_8000", "no_ingress_type", "unselected_pods",
                                    "ray_ports_to_trainers"])
def test_a_loosened_network_policy_fails(breach):
    policy = copy.deepcopy(network_policy())
    spec = policy["spec"]
    if breach == "allow_all_rule":
        spec["ingress"].append({})
    elif breach == "any_namespace_on_8000":
        spec["ingress"].append({"from": [{"namespaceSelector": {}}], "ports": [{"port": 8000}]})
    elif breach == "no_ingress_type":
        spec["policyTypes"] = ["Egress"]
    elif breach == "unselected_pods":
        spec["podSelector"] = {"matchLabels": {"app.kubernetes.io/name": "rollout"}}
    else:
        spec["ingress"][1]["ports"] = []  # the trainers' rule without ports: every port
    assert policy_errors(policy) != []

