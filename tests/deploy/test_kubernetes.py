"""Kubernetes: every manifest in deploy/kubernetes validates (strict: no unknown field) against
the Kubernetes schemas kubernetes-validate ships, no cluster needed; the ConfigMap's TOML loads
as a captiond config; and what the daemon relies on holds together: one GPU per container,
/healthz and /readyz probes, a grace period longer than preStop plus the drain, the one
ReadWriteMany journal mounted where the config says, websocket timeouts at the Ingress, the
scrape annotations, selectors that match the pods, and a kustomization listing every file."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]
from testkit import REPO_ROOT, missing_tool

from captiond.config import load_config, override

MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
# The Kubernetes version the manifests are validated against: the newest whose schemas the
# pinned kubernetes-validate (pyproject.toml) ships.
KUBERNETES_VERSION = "1.37.0"
# Not a Kubernetes object: kustomize's own file.
KUSTOMIZATION = "kustomization.yaml"

Doc = dict[str, Any]


def _kubernetes_validate() -> Any:
    """The kubernetes_validate module (untyped): skipped locally without it, failed in CI."""
    try:
        import kubernetes_validate  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        missing_tool("kubernetes-validate is not installed (pip install -e '.[test]')")
    return kubernetes_validate


def _files() -> list[Path]:
    return sorted(MANIFESTS.glob("*.yaml"))


def _documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects() -> list[Doc]:
    return [doc for path in _files() if path.name != KUSTOMIZATION for doc in _documents(path)]


def _one(kind: str, name: str | None = None) -> Doc:
    found = [
        doc
        for doc in _objects()
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in {MANIFESTS}"
    return found[0]


def _config_text() -> str:
    text: str = _one("ConfigMap", "captiond-config")["data"]["captiond.toml"]
    return text


def _config() -> dict[str, Any]:
    return tomllib.loads(_config_text())


def _statefulset() -> Doc:
    return _one("StatefulSet", "captiond")


def _pod_spec() -> Doc:
    spec: Doc = _statefulset()["spec"]["template"]["spec"]
    return spec


def _container() -> Doc:
    containers: list[Doc] = _pod_spec()["containers"]
    assert [c["name"] for c in containers] == ["captiond"]
    return containers[0]


def _pod_labels() -> dict[str, str]:
    labels: dict[str, str] = _statefulset()["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects_the_pods(match_labels: dict[str, str]) -> bool:
    labels = _pod_labels()
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def test_every_manifest_passes_the_strict_kubernetes_schema() -> None:
    validate: Callable[..., str] = _kubernetes_validate().validate
    objects = _objects()
    assert {doc["kind"] for doc in objects} >= {
        "ConfigMap",
        "StatefulSet",
        "Service",
        "Ingress",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
    }
    for doc in objects:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        # A ValidationError (or a schema it cannot find) fails the test, naming the object.
        assert validate(doc, KUBERNETES_VERSION, strict=True) == "1.37", where


def test_the_strict_schema_refuses_a_misspelled_field() -> None:
    kubernetes_validate = _kubernetes_validate()
    broken = _statefulset()
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"path": "/readyz"}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _documents(MANIFESTS / KUSTOMIZATION)
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in _files() if p.name != KUSTOMIZATION}


def test_the_configmap_is_a_captiond_config(tmp_path: Path) -> None:
    # load_config refuses unknown sections and keys: a key the daemon lacks fails here.
    path = tmp_path / "captiond.toml"
    path.write_text(_config_text())
    config = load_config(path)
    assert config.server.host == "0.0.0.0"
    assert config.journal.dir and config.server.drain_timeout_s > 0
    assert config.engine.name == "torch_graph" and config.engine.device == "cuda"

    # The daemon reads it where the ConfigMap is mounted, and listens on the container's port.
    container = _container()
    config_dir = "/etc/captiond"
    assert {"name": "config", "mountPath": config_dir, "readOnly": True} in container[
        "volumeMounts"
    ]
    (config_volume,) = [v for v in _pod_spec()["volumes"] if v["name"] == "config"]
    assert config_volume["configMap"]["name"] == "captiond-config"
    assert container["command"] == ["captiond"]
    args = container["args"]
    assert args[0] == "serve"
    assert args[args.index("--config") + 1] == f"{config_dir}/captiond.toml"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.server.port}


def test_each_pod_names_its_instance_after_itself() -> None:
    container = _container()
    args = container["args"]
    assert args[args.index("--instance") + 1] == "$(POD_NAME)"
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    statefulset = _statefulset()
    spec = statefulset["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert spec["updateStrategy"]["type"] == "RollingUpdate"
    # Every pod's name (<statefulset>-<ordinal>) is one the daemon takes as its instance.
    for ordinal in range(spec["replicas"]):
        name = f"{statefulset['metadata']['name']}-{ordinal}"
        assert override(load_config(None), "server", instance=name).server.instance == name
    headless = _one("Service", spec["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def test_every_container_gets_one_gpu() -> None:
    for container in _pod_spec()["containers"]:
        resources = container["resources"]
        assert str(resources["limits"]["nvidia.com/gpu"]) == "1", container["name"]
        assert str(resources["requests"]["nvidia.com/gpu"]) == "1", container["name"]
        assert {"cpu", "memory"} <= set(resources["requests"])


def test_probes_and_the_drain_fit_the_daemon() -> None:
    container = _container()
    probes = {
        kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
        for kind in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert probes == {
        "startupProbe": ("/healthz", "http"),
        "livenessProbe": ("/healthz", "http"),
        "readinessProbe": ("/readyz", "http"),
    }
    startup = container["startupProbe"]
    # Model loading and warm-up take minutes.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = _config()["server"]["drain_timeout_s"]
    grace = _pod_spec()["terminationGracePeriodSeconds"]
    assert grace > float(pre_stop[1]) + drain, (grace, pre_stop, drain)


def test_every_pod_mounts_the_one_shared_journal() -> None:
    pvc = _one("PersistentVolumeClaim", "captiond-journal")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # The pod template's own volume, not a volumeClaimTemplate (one volume per pod).
    assert "volumeClaimTemplates" not in _statefulset()["spec"]
    (journal,) = [
        v["name"]
        for v in _pod_spec()["volumes"]
        if v.get("persistentVolumeClaim", {}).get("claimName") == "captiond-journal"
    ]
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    assert mounts[journal] == _config()["journal"]["dir"]


def test_the_container_is_locked_down() -> None:
    pod = _pod_spec()["securityContext"]
    container = _container()
    security = container["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    # What the daemon writes lies on volumes: the journal, and the cache (models, kernels).
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    cache = mounts[env["XDG_CACHE_HOME"]]
    (volume,) = [v for v in _pod_spec()["volumes"] if v["name"] == cache]
    assert "emptyDir" in volume


def test_prometheus_scrapes_the_pods() -> None:
    annotations = _statefulset()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(_config()["server"]["port"])
    assert annotations["prometheus.io/path"] == "/metrics"


def test_selectors_match_the_pods() -> None:
    assert _selects_the_pods(_statefulset()["spec"]["selector"]["matchLabels"])
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert _selects_the_pods(pdb["spec"]["selector"]["matchLabels"])
    services = [doc for doc in _objects() if doc["kind"] == "Service"]
    assert len(services) == 2
    for service in services:
        assert _selects_the_pods(service["spec"]["selector"]), service["metadata"]["name"]
        ports = [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]]
        assert ports == [(8765, "http")], service["metadata"]["name"]


def test_the_ingress_keeps_websockets_open_without_affinity() -> None:
    ingress = _one("Ingress", "captiond")
    annotations = ingress["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    # nginx's 60 s default would cut a stream that is quiet for a minute.
    assert int(annotations[prefix + "proxy-read-timeout"]) > 60
    assert int(annotations[prefix + "proxy-send-timeout"]) > 60
    assert prefix + "proxy-body-size" in annotations
    # A resume may land on any pod: no hashing or sticky sessions.
    assert not {prefix + "upstream-hash-by", prefix + "affinity"} & set(annotations)

    spec = ingress["spec"]
    assert spec["ingressClassName"] == "nginx"
    (rule,) = spec["rules"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    backend = path["backend"]["service"]
    service = _one("Service", backend["name"])
    assert service["spec"]["type"] == "ClusterIP"
    assert backend["port"]["number"] == 8765
