"""Generated Kubernetes manifests against the real schemas, with secrets planted to leak.

No API server runs here, so the job objects are checked against the Kubeflow CRDs'
openAPIV3Schema (made strict: an unknown field fails, as it would be silently dropped by
the API server) and the core objects against kubernetes-validate.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO, TINY, trainyard

SCHEMAS = REPO.parent / "shared" / "schemas"
PLANTED_ENV = {"WANDB_API_KEY": "wandb-planted-0123456789abcdef", "HF_TOKEN": "hf_plantedTOKENvalue987654"}
PLANTED_CONFIG_KEY = "sk-planted-config-secret-555"
NETWORK = ("dist.network=wan", "dist.nic=eth1")


def strict(schema: Any) -> Any:
    """Forbid properties a schema does not list, unless it keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@functools.cache
def _load_crd_schema(path: Path) -> dict[str, Any]:
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    return strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def crd_schema(file: str) -> dict[str, Any]:
    path = SCHEMAS / file
    if not path.is_file():
        pytest.skip(f"CRD schema {path} not found (CI keeps shared/ beside the clone)")
    return _load_crd_schema(path)


def generate(tmp_path: Path, *options: str) -> tuple[str, dict[str, dict[str, Any]]]:
    out = tmp_path / "job.yaml"
    result = trainyard(
        "k8s",
        TINY,
        f"data.path=/data/{PLANTED_ENV['HF_TOKEN']}/train.jsonl",
        f"model.config.api_key={PLANTED_CONFIG_KEY}",
        "--image",
        "registry.example.com/ml/trainyard:0.1",
        "--namespace",
        "ml",
        "--out",
        str(out),
        "--skip-data-check",  # the data lives on the cluster's volume, not here
        *options,
        cwd=tmp_path,
        env=PLANTED_ENV,
    )
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    return text, {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def assert_no_secret(text: str) -> None:
    for value in [*PLANTED_ENV.values(), PLANTED_CONFIG_KEY]:
        assert value not in text


def assert_network_env(env: list[dict[str, Any]]) -> None:
    """The job's dist.network / dist.nic, as plain env entries the schema accepted."""
    values = {entry["name"]: entry.get("value") for entry in env}
    assert values["NCCL_SOCKET_IFNAME"] == values["GLOO_SOCKET_IFNAME"] == "eth1"
    assert values["NCCL_IB_DISABLE"] == "1" and values["NCCL_NET"] == "Socket"


def validate_core(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


@pytest.fixture(scope="module")
def pytorchjob(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, dict[str, Any]]]:
    options = ("--nodes", "4", "--gpus-per-node", "8", "--secret", "team-tokens", "--secret", "HF_TOKEN=hf:token")
    return generate(tmp_path_factory.mktemp("k8s"), *NETWORK, *options)


def test_pytorchjob_manifests_validate_and_hold_no_secret(pytorchjob: tuple[str, dict[str, dict[str, Any]]]) -> None:
    text, docs = pytorchjob
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "PyTorchJob"}
    jsonschema.validate(docs["PyTorchJob"], crd_schema("kubeflow.org_pytorchjobs.yaml"))
    validate_core(docs["ConfigMap"])
    validate_core(docs["PersistentVolumeClaim"])
    assert_no_secret(text)
    env = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    refs = {entry["name"]: entry["valueFrom"]["secretKeyRef"] for entry in env if "valueFrom" in entry}
    assert refs["HF_TOKEN"] == {"name": "hf", "key": "token", "optional": False}
    assert refs["WANDB_API_KEY"]["name"] == "team-tokens"
    assert_network_env(env)
    assert "restartPolicy ExitCode" in text and "retryable" in text  # the comments explain the restart rule


def test_trainjob_manifests_validate_and_hold_no_secret(tmp_path: Path) -> None:
    text, docs = generate(
        tmp_path, *NETWORK, "--kind", "trainjob", "--nodes", "2", "--nproc-per-node", "2", "--secret", "team-tokens"
    )
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "TrainingRuntime", "TrainJob"}
    jsonschema.validate(docs["TrainJob"], crd_schema("trainer.kubeflow.org_trainjobs.yaml"))
    validate_core(docs["ConfigMap"])
    validate_core(docs["PersistentVolumeClaim"])
    # No TrainingRuntime CRD is at hand; the batch Job it stamps out is a core object.
    replicated = docs["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0]
    validate_core(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "node"}, "spec": replicated["template"]["spec"]}
    )
    assert_no_secret(text)
    assert_network_env(docs["TrainJob"]["spec"]["trainer"]["env"])


def test_strict_schema_catches_a_misplaced_field(pytorchjob: tuple[str, dict[str, dict[str, Any]]]) -> None:
    job = copy.deepcopy(pytorchjob[1]["PyTorchJob"])
    job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicyy"] = "ExitCode"
    with pytest.raises(jsonschema.ValidationError, match="restartPolicyy"):
        jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.yaml"))


def test_fault_tolerant_sites_and_their_lighthouse_validate() -> None:
    """A fault-tolerant DiLoCo job: a PyTorchJob per site, the lighthouse's Deployment and Service, all accepted.
    Rendered in this process: the CLI's path to it is the one the tests above take."""
    from trainyard.launch.ft_cluster import load_job, render_manifests
    from trainyard.launch.k8s import K8sJob

    ft = ["dist.strategy=diloco", "diloco.fault_tolerant=true", "diloco.sites=2", "diloco.lighthouse=lh:29600",
          f"model.config.api_key={PLANTED_CONFIG_KEY}", *NETWORK]
    job = K8sJob(nodes=2, gpus_per_node=8, image="registry.example.com/ml/trainyard:0.1", namespace="ml",
                 secrets=("team-tokens",))
    text = render_manifests(load_job(TINY, ft), job)
    docs = list(yaml.safe_load_all(text))
    kinds = [doc["kind"] for doc in docs]
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "Service", "Deployment", "PyTorchJob", "PyTorchJob"]
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            jsonschema.validate(doc, crd_schema("kubeflow.org_pytorchjobs.yaml"))
        else:
            validate_core(doc)
    assert_no_secret(text)
