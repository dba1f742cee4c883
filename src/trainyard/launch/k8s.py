"""Kubernetes manifests for a job: a Kubeflow PyTorchJob or a Trainer v2 TrainJob, plus
the ConfigMap holding the job, a ReadWriteMany volume for checkpoints and caches, and
secrets referenced by name only.

Seed 003 pasted a W&B key into a chat log while wiring a secret by hand, and restarted
its job by deleting it. Here a secret value never enters a generated file (env entries are
`secretKeyRef`s, the config goes through `dump_config`, which redacts), and a pod that
stops after committing a checkpoint is restarted by the operator on its own.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from trainyard.config import JobConfig
from trainyard.config_file import dump_config
from trainyard.errors import ConfigError, OptionError
from trainyard.launch.stop_lead import estimated_lead
from trainyard.launch.torchrun import PREEMPTED_EXIT_CODE
from trainyard.network import network_env
from trainyard.redaction import redact_text

KINDS = ("pytorchjob", "trainjob")
CONFIG_DIR = "/etc/trainyard"
CONFIG_FILE = f"{CONFIG_DIR}/job.yaml"
DATA_MOUNT = "/mnt/trainyard"
DEFAULT_SECRET_KEYS = ("WANDB_API_KEY", "HF_TOKEN")
USER_ERROR_EXIT_CODE = 2
# The training operator treats exit codes 1-127 as permanent and 128-255 as retryable
# under restartPolicy ExitCode, so "preempted after a checkpoint" (75) is lifted to 128+75.
RETRYABLE_PREEMPTED_EXIT_CODE = 128 + PREEMPTED_EXIT_CODE
PYTORCHJOB_PORT = 23456
SHUTDOWN_MARGIN_S = 15
"""The agent stops waiting for workers this long before the kubelet's SIGKILL."""
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
"""builtin:NAME, hf://NAME, s3://...: sources that are not a path on a disk."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class K8sJob:
    nodes: int
    gpus_per_node: int
    image: str
    kind: str = "pytorchjob"
    namespace: str = "default"
    pvc: str | None = None
    """An existing ReadWriteMany claim to use; None writes one named <job>-data."""
    storage: str = "100Gi"
    storage_class: str | None = None
    secrets: tuple[str, ...] = ()
    """NAME (WANDB_API_KEY and HF_TOKEN from that Secret) or VAR=NAME:KEY."""
    nproc_per_node: int | None = None
    grace_s: int = 300
    """terminationGracePeriodSeconds: time for the preemption save after SIGTERM (`with_estimated_grace`)."""
    grace_reason: str = "--grace"
    backoff_limit: int = 10
    runtime: str | None = None
    """TrainJob only: an existing ClusterTrainingRuntime instead of the generated runtime."""
    memory_gib: int | None = None
    """Host memory a pod requests: `trainyard estimate`'s peak for one node (estimate/host.py)."""
    overrides: tuple[str, ...] = ()
    """key=value after the job file on every pod's command line: a fault-tolerant DiLoCo site's diloco.site."""


def k8s_name(run_name: str) -> str:
    """A DNS-1123 label from the run name, short enough for the pod names operators derive."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")[:40].strip("-")
    return name or "trainyard"


def check_options(job: K8sJob) -> None:
    if job.kind not in KINDS:
        raise OptionError(
            f"--kind '{job.kind}' is not one of {', '.join(KINDS)}", fix="use --kind pytorchjob or --kind trainjob"
        )
    if job.nodes < 1:
        raise OptionError(f"--nodes {job.nodes} must be at least 1", fix="for example --nodes 2")
    if job.gpus_per_node < 0:
        raise OptionError(f"--gpus-per-node {job.gpus_per_node} is negative", fix="use 0 for CPU-only nodes")
    if job.grace_s <= SHUTDOWN_MARGIN_S:
        raise OptionError(
            f"--grace {job.grace_s} leaves no time to save",
            fix=f"give more than {SHUTDOWN_MARGIN_S} seconds, e.g. --grace 300",
        )
    if not job.image or any(c.isspace() for c in job.image):
        raise OptionError(
            f"--image '{job.image}' is not an image reference",
            fix="for example --image registry.example.com/team/trainyard:1.0",
        )
    if job.runtime is not None and job.kind != "trainjob":
        raise OptionError(
            f"--runtime {job.runtime} is for --kind trainjob; a PyTorchJob has no runtime",
            fix="add --kind trainjob, or leave --runtime out",
        )
    if job.storage_class is not None and job.pvc is not None:
        raise OptionError(
            f"--storage-class {job.storage_class} is for the claim trainyard writes, and --pvc {job.pvc} is used "
            "instead of one",
            fix="leave --storage-class out with --pvc",
        )


def nproc_per_node(job: K8sJob) -> int:
    return job.nproc_per_node or job.gpus_per_node or 1


def with_estimated_grace(job: K8sJob, cfg: JobConfig, kind: str) -> K8sJob:
    """Slurm's signal-lead rule (launch/stop_lead.py) for the grace period: a fixed 300 s cut a large save short."""
    lead = estimated_lead(cfg, kind, nproc_per_node(job), job.nodes, SHUTDOWN_MARGIN_S, "--grace")
    return replace(job, grace_s=lead.seconds, grace_reason=lead.reason)


def secret_env(specs: tuple[str, ...]) -> list[dict[str, Any]]:
    """Env entries that point into Secrets; the values stay in the cluster."""
    entries: dict[str, dict[str, Any]] = {}
    for spec in specs:
        match = re.fullmatch(r"(?:([A-Za-z_][A-Za-z0-9_]*)=)?([a-z0-9][a-z0-9.-]*)(?::([A-Za-z0-9._-]+))?", spec)
        if not match:
            raise OptionError(
                f"--secret '{spec}' is not a Secret's NAME or VAR=NAME:KEY (a Secret's name is lower case)",
                fix=f"e.g. --secret team-tokens (its keys {' and '.join(DEFAULT_SECRET_KEYS)} become those "
                f"variables), or --secret {spec if _is_variable(spec) else 'WANDB_API_KEY'}=wandb:api-key",
            )
        var, secret, key = match.groups()
        pairs = [(var, key or var)] if var else [(name, key or name) for name in DEFAULT_SECRET_KEYS]
        for env_name, secret_key in pairs:
            # optional for the default keys: a Secret holding only one of them is fine
            ref = {"name": secret, "key": secret_key, "optional": not var}
            entries[env_name] = {"name": env_name, "valueFrom": {"secretKeyRef": ref}}
    return list(entries.values())


def _is_variable(spec: str) -> bool:
    """`--secret WANDB_API_KEY`: a variable's name where a Secret's name belongs."""
    return re.fullmatch(r"[A-Z_][A-Z0-9_]*", spec) is not None


@dataclass(frozen=True)
class Move:
    """A path of the job moved onto the shared volume for the pods."""

    field: str
    before: str
    after: str
    is_input: bool
    """An input (data, model) must be copied onto the claim; an output is written there."""

    def describe(self) -> str:
        if not self.is_input:
            return f"{self.field}: {self.before} -> {self.after}"
        on_claim = PurePosixPath(self.after).relative_to(DATA_MOUNT)
        return f"{self.field}: {self.before} -> {self.after} (copy it onto the claim as {on_claim})"


def _on_volume(cfg: JobConfig, field: str, path: str) -> str:
    """The path on the shared volume: relative ones under it, absolute ones outside it re-rooted under it.
    A home folder (~) or a path climbing out with .. is refused: the pod would resolve it on its own disk."""
    pure = PurePosixPath(path)
    if pure.is_relative_to(DATA_MOUNT):
        return path
    if path.startswith("~") or ".." in pure.parts:
        raise ConfigError(
            f"{field} '{path}' cannot be placed on the shared volume ({DATA_MOUNT}): "
            + ("a home folder is each pod's own" if path.startswith("~") else ".. climbs out of it"),
            where=cfg.where(field),
            fix=f"write it relative to the volume (e.g. runs) or as a path under {DATA_MOUNT}",
        )
    return str(PurePosixPath(DATA_MOUNT) / (pure.relative_to("/") if pure.is_absolute() else pure))


def _is_local_model(path: str) -> bool:
    """A folder or file rather than a hub id: it exists here, or could not be a hub id (owner/name)."""
    return Path(path).expanduser().exists() or path.endswith(".gguf") or not _HUB_ID.fullmatch(path)


def _path_fields(cfg: JobConfig) -> list[tuple[str, str, bool]]:
    """(field, path, is_input) of every path a pod reads or writes; URLs, built-ins and hub ids are not paths."""
    data, model = cfg.data, cfg.model
    outputs = [("output_dir", cfg.output_dir), ("data.cache_dir", data.cache_dir), ("data.shards_dir", data.shards_dir),
               ("model.cache_dir", model.cache_dir)]
    inputs = [("data.eval_path", data.eval_path)]
    inputs += [(f"data.mixture[{i}].path", source.path) for i, source in enumerate(data.mixture or [])]
    inputs += [] if data.mixture else [("data.path", data.path)]
    inputs += [(name, path) for name, path in (("model.path", model.path), ("model.tokenizer", model.tokenizer))
               if path and _is_local_model(path)]
    return [(field, path, False) for field, path in outputs if path] + [
        (field, path, True) for field, path in inputs if path and not _URL.match(path)
    ]


def volume_moves(cfg: JobConfig) -> list[Move]:
    """Every run path that is not on the shared volume yet, and where it goes: never the pod's own disk."""
    moves = [Move(field, path, _on_volume(cfg, field, path), is_input) for field, path, is_input in _path_fields(cfg)]
    return [move for move in moves if move.after != move.before]


def cluster_config(cfg: JobConfig) -> JobConfig:
    """The job as the pods see it: every run path on the shared volume, the model cache too by default."""
    after = {move.field: move.after for move in volume_moves(cfg)}
    mixture = [
        source.model_copy(update={"path": after.get(f"data.mixture[{i}].path", source.path)})
        for i, source in enumerate(cfg.data.mixture or [])
    ]
    data_update = {name: after[f"data.{name}"] for name in ("path", "eval_path", "cache_dir", "shards_dir")
                   if f"data.{name}" in after}
    data = cfg.data.model_copy(update={**data_update, **({"mixture": mixture} if mixture else {})})
    model_update = {name: after[f"model.{name}"] for name in ("path", "tokenizer") if f"model.{name}" in after}
    cache_dir = after.get("model.cache_dir", cfg.model.cache_dir or f"{DATA_MOUNT}/cache/models")
    model = cfg.model.model_copy(update={**model_update, "cache_dir": cache_dir})
    output_dir = after.get("output_dir", cfg.output_dir)
    return cfg.model_copy(update={"output_dir": output_dir, "model": model, "data": data})


def _container_env(cfg: JobConfig, job: K8sJob) -> list[dict[str, Any]]:
    env = [{"name": name, "value": value} for name, value in network_env(cfg.dist.network, cfg.dist.nic).items()]
    env.append({"name": "HF_HOME", "value": f"{DATA_MOUNT}/cache/huggingface"})
    return env + secret_env(job.secrets)


def _volumes(name: str, job: K8sJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes = [
        {"name": "job-config", "configMap": {"name": f"{name}-config"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": job.pvc or f"{name}-data"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "data", "mountPath": DATA_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def _resources(job: K8sJob) -> dict[str, Any]:
    """GPUs as a limit (the device plugin's rule); the estimated host memory as a request, so the scheduler places
    a pod where it fits and the kubelet does not evict it first under memory pressure."""
    memory = {"memory": f"{job.memory_gib}Gi"} if job.memory_gib else {}
    if job.gpus_per_node:
        return {"limits": {"nvidia.com/gpu": job.gpus_per_node}, **({"requests": memory} if memory else {})}
    return {"requests": {"cpu": nproc_per_node(job), **memory}}


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "trainyard", "app.kubernetes.io/instance": name}


def config_map(name: str, namespace: str, cfg: JobConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config", "namespace": namespace, "labels": labels(name)},
        "data": {"job.yaml": dump_config(cfg)},
    }


def volume_claim(name: str, job: K8sJob) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": job.storage}}}
    if job.storage_class:
        spec["storageClassName"] = job.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{name}-data", "namespace": job.namespace, "labels": labels(name)},
        "spec": spec,
    }


def _pytorchjob_pod(name: str, cfg: JobConfig, job: K8sJob) -> dict[str, Any]:
    volumes, mounts = _volumes(name, job)
    command = [
        "trainyard", "launch", CONFIG_FILE, *job.overrides, "--nnodes", str(job.nodes), "--nproc",
        str(nproc_per_node(job)),
        # RANK, MASTER_ADDR and MASTER_PORT are set by the operator: pod index, master service
        "--node-rank", "$(RANK)", "--master", "$(MASTER_ADDR):$(MASTER_PORT)",
        "--shutdown-timeout", str(job.grace_s - SHUTDOWN_MARGIN_S),
        "--preempt-exit-code", str(RETRYABLE_PREEMPTED_EXIT_CODE),
    ]
    container = {
        "name": "pytorch",  # the operator injects its variables into the container of this name
        "image": job.image,
        "command": command,
        "env": _container_env(cfg, job),
        "ports": [{"name": "pytorchjob-port", "containerPort": PYTORCHJOB_PORT}],
        "resources": _resources(job),
        "volumeMounts": mounts,
    }
    return {
        "metadata": {"labels": labels(name)},
        "spec": {"terminationGracePeriodSeconds": job.grace_s, "containers": [container], "volumes": volumes},
    }


def pytorchjob(name: str, cfg: JobConfig, job: K8sJob) -> dict[str, Any]:
    pod = _pytorchjob_pod(name, cfg, job)
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": pod}}
    if job.nodes > 1:
        replicas["Worker"] = {"replicas": job.nodes - 1, "restartPolicy": "ExitCode", "template": pod}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": job.namespace, "labels": labels(name)},
        "spec": {
            "nprocPerNode": str(nproc_per_node(job)),
            "runPolicy": {"backoffLimit": job.backoff_limit},
            "pytorchReplicaSpecs": replicas,
        },
    }


def _on_exit_code(action: str, code: int) -> dict[str, Any]:
    return {"action": action, "onExitCodes": {"containerName": "node", "operator": "In", "values": [code]}}


def training_runtime(name: str, job: K8sJob) -> dict[str, Any]:
    """A namespaced runtime whose pod failure policy retries exit 75 and stops on exit 2."""
    job_spec = {
        "backoffLimit": job.backoff_limit,
        "podFailurePolicy": {
            "rules": [
                _on_exit_code("Ignore", PREEMPTED_EXIT_CODE),
                _on_exit_code("FailJob", USER_ERROR_EXIT_CODE),
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {
            "spec": {
                "restartPolicy": "Never",  # required by podFailurePolicy
                "terminationGracePeriodSeconds": job.grace_s,
                "containers": [{"name": "node", "image": job.image}],
            }
        },
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": {"name": f"{name}-runtime", "namespace": job.namespace, "labels": labels(name)},
        "spec": {
            "mlPolicy": {"numNodes": job.nodes, "torch": {"numProcPerNode": nproc_per_node(job)}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                "spec": job_spec,
                            },
                        }
                    ]
                }
            },
        },
    }


def trainjob(name: str, cfg: JobConfig, job: K8sJob) -> dict[str, Any]:
    volumes, mounts = _volumes(name, job)
    runtime = (
        {"name": job.runtime, "kind": "ClusterTrainingRuntime"}
        if job.runtime
        else {"name": f"{name}-runtime", "kind": "TrainingRuntime"}
    )
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": job.namespace, "labels": labels(name)},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", **runtime},
            "trainer": {
                "image": job.image,
                # PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT come from the controller
                "command": ["trainyard", "launch", CONFIG_FILE, *job.overrides,
                            "--shutdown-timeout", str(job.grace_s - SHUTDOWN_MARGIN_S)],
                "numNodes": job.nodes,
                "numProcPerNode": nproc_per_node(job),
                "resourcesPerNode": _resources(job),
                "env": _container_env(cfg, job),
            },
            "podSpecOverrides": [
                {
                    "targetJobs": [{"name": "node"}],
                    "volumes": volumes,
                    "containers": [{"name": "node", "volumeMounts": mounts}],
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the job config) as readable `|` blocks; no anchors, each pod spelled out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def document(comment: str, obj: dict[str, Any]) -> str:
    """One YAML document under its comment; the comment is redacted (paths may hold a token's value)."""
    lines = [f"# {line}" if line else "#" for line in redact_text(comment).strip().splitlines()]
    return "\n".join(lines) + "\n" + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100)


def _moves_note(cfg: JobConfig) -> str:
    moves = volume_moves(cfg)
    if not moves:
        return f"Every path of the job was already on the shared volume at {DATA_MOUNT}."
    lines = [f"Paths moved onto the shared volume at {DATA_MOUNT} (a pod's own disk dies with it):"]
    return "\n".join(lines + [f"  {move.describe()}" for move in moves])


def _memory_note(job: K8sJob) -> str:
    if not job.memory_gib:
        return ""
    return (f"\nresources.requests.memory {job.memory_gib}Gi: the host memory `trainyard estimate` predicts for one "
            "node's processes\n(libraries, the load and async-save copies, a random init drawn once per node).")


def comments(name: str, cfg: JobConfig, job: K8sJob) -> dict[str, str]:
    grace, why = job.grace_s, textwrap.fill(f"{job.grace_s} s: {job.grace_reason}.", 110, subsequent_indent="  ")
    return {
        "config": f"""
The job as every pod reads it ({CONFIG_FILE}): overrides applied, every run path (outputs, caches,
data and a local model) on the shared volume, secret-looking values redacted.
{_moves_note(cfg)}""",
        "pvc": f"""
Checkpoints, the run dir and the data/model caches: ReadWriteMany, so every node reads and
writes the same run dir ({cfg.output_dir}/{cfg.run_name} becomes {cluster_config(cfg).run_dir}).
`trainyard status` on any pod that mounts it shows progress.""",
        "pytorchjob": f"""
Kubeflow PyTorchJob '{name}': {job.nodes} pod(s) x {nproc_per_node(job)} process(es), one `trainyard launch` per pod.
restartPolicy ExitCode: the operator recreates a pod whose exit code is retryable (128-255)
and fails the job on 1-127. trainyard exits 75 when it stopped on SIGTERM after committing a
checkpoint; --preempt-exit-code {RETRYABLE_PREEMPTED_EXIT_CODE} lifts that into the retryable range, so a
preempted pod comes back and resumes from checkpoints/LATEST. A config error (2) or a crash (1)
stays failed instead of looping. A node that vanishes is retried (137); runPolicy.backoffLimit caps retries.
terminationGracePeriodSeconds {grace}: SIGTERM reaches trainyard, the workers save, and torchrun
gives them {grace - SHUTDOWN_MARGIN_S} s before it kills them, ahead of the kubelet's SIGKILL.
{why}
Secrets are env entries from Secrets (secretKeyRef): no value is in this file.{_memory_note(job)}""",
        "runtime": f"""
A TrainingRuntime for '{name}' (Kubeflow Trainer v2). Its Job's podFailurePolicy carries the
restart rules: exit 75 (stopped after a committed checkpoint) is ignored by the backoff count and
the pod is recreated; exit 2 (a config error) fails the job at once; an evicted or preempted pod
(DisruptionTarget) is retried free. Anything else counts towards backoffLimit ({job.backoff_limit}).
terminationGracePeriodSeconds {grace} gives the preemption save its time.
{why}""",
        "trainjob": f"""
Kubeflow Trainer v2 TrainJob '{name}': {job.nodes} node(s) x {nproc_per_node(job)} process(es). The controller sets
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and PET_MASTER_ADDR/PORT; `trainyard launch` reads them.
Restarts and the grace period come from the runtime it references ({job.runtime or f"{name}-runtime, above"}).
Secrets are env entries from Secrets (secretKeyRef): no value is in this file.{_memory_note(job)}""",
    }


def render_manifests(cfg: JobConfig, job: K8sJob) -> str:
    """All documents, in the order `kubectl apply -f` should create them."""
    check_options(job)
    name = k8s_name(cfg.run_name)
    pod_cfg = cluster_config(cfg)
    notes = comments(name, cfg, job)
    documents = [document(notes["config"], config_map(name, job.namespace, pod_cfg))]
    if job.pvc is None:
        documents.append(document(notes["pvc"], volume_claim(name, job)))
    if job.kind == "pytorchjob":
        documents.append(document(notes["pytorchjob"], pytorchjob(name, pod_cfg, job)))
    else:
        if job.runtime is None:
            documents.append(document(notes["runtime"], training_runtime(name, job)))
        documents.append(document(notes["trainjob"], trainjob(name, pod_cfg, job)))
    header = (
        f"# trainyard job '{cfg.run_name}' for Kubernetes, written by `trainyard k8s`. "
        "Apply with: kubectl apply -f THIS_FILE\n"
    )
    return header + "---\n".join(documents)
