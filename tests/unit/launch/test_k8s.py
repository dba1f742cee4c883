"""`trainyard k8s`: the objects written, restart rules, secret references and user errors.

Validation against the CRD and core schemas is in tests/e2e/test_k8s.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, run_cli
from trainyard.config_file import load_config
from trainyard.errors import ConfigError, OptionError
from trainyard.launch.k8s import (
    RETRYABLE_PREEMPTED_EXIT_CODE,
    K8sJob,
    cluster_config,
    k8s_name,
    render_manifests,
    secret_env,
    with_estimated_grace,
)
from trainyard.network import network_env


def documents(text: str) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(text)}


def render(overrides: tuple[str, ...] = (), **options) -> dict[str, dict]:
    options.setdefault("nodes", 2)
    options.setdefault("gpus_per_node", 8)
    options.setdefault("image", "registry.example/trainyard:1")
    return documents(render_manifests(load_config(TINY, list(overrides)), K8sJob(**options)))


def test_pytorchjob_has_a_master_and_n_minus_one_workers() -> None:
    docs = render(nodes=3)
    specs = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert {spec["restartPolicy"] for spec in specs.values()} == {"ExitCode"}
    assert docs["PyTorchJob"]["spec"]["nprocPerNode"] == "8"
    assert "Worker" not in render(nodes=1)["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]


def test_pytorchjob_pod_runs_trainyard_launch_with_a_retryable_preemption_code() -> None:
    pod = render(grace_s=600)["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch" and container["command"][:3] == [
        "trainyard",
        "launch",
        "/etc/trainyard/job.yaml",
    ]
    command = " ".join(container["command"])
    assert f"--preempt-exit-code {RETRYABLE_PREEMPTED_EXIT_CODE}" in command and RETRYABLE_PREEMPTED_EXIT_CODE >= 128
    assert "--node-rank $(RANK) --master $(MASTER_ADDR):$(MASTER_PORT)" in command
    assert pod["terminationGracePeriodSeconds"] == 600 and "--shutdown-timeout 585" in command
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/trainyard", "/mnt/trainyard", "/dev/shm"}


def test_config_map_holds_the_job_with_outputs_on_the_shared_volume() -> None:
    docs = render(("train.max_steps=7",))
    job = yaml.safe_load(docs["ConfigMap"]["data"]["job.yaml"])
    assert job["train"]["max_steps"] == 7 and job["output_dir"] == "/mnt/trainyard/runs"
    assert job["model"]["config"]["num_key_value_heads"] == 2  # a model field is not mistaken for a secret
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_existing_claim_is_used_not_written() -> None:
    docs = render(pvc="team-shared")
    assert "PersistentVolumeClaim" not in docs
    volumes = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "team-shared"}} in volumes


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_network_preset_goes_into_every_pod_env(kind: str) -> None:
    docs = render(("dist.network=wan", "dist.nic=eth0"), kind=kind)
    if kind == "pytorchjob":
        specs = docs["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].values()
        envs = [spec["template"]["spec"]["containers"][0]["env"] for spec in specs]
    else:
        envs = [docs["TrainJob"]["spec"]["trainer"]["env"]]
    for env in envs:
        values = {entry["name"]: entry.get("value") for entry in env}
        assert network_env("wan", "eth0").items() <= values.items()
        assert values["GLOO_SOCKET_IFNAME"] == values["NCCL_SOCKET_IFNAME"] == "eth0"


def test_secrets_are_references_only() -> None:
    env = secret_env(("team-tokens", "WANDB_API_KEY=wandb:api-key"))
    by_name = {entry["name"]: entry for entry in env}
    assert by_name["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "team-tokens",
        "key": "HF_TOKEN",
        "optional": True,
    }
    assert by_name["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "wandb",
        "key": "api-key",
        "optional": False,
    }
    assert all("value" not in entry for entry in env)


def test_trainjob_writes_a_runtime_with_the_exit_code_rules() -> None:
    docs = render(kind="trainjob", gpus_per_node=0, nproc_per_node=2)
    assert docs["TrainJob"]["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "name": "tiny-runtime",
        "kind": "TrainingRuntime",
    }
    assert docs["TrainJob"]["spec"]["trainer"]["numProcPerNode"] == 2
    job = docs["TrainingRuntime"]["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = {
        (rule["action"], tuple(rule.get("onExitCodes", {}).get("values", ())))
        for rule in job["podFailurePolicy"]["rules"]
    }
    assert ("Ignore", (75,)) in rules and ("FailJob", (2,)) in rules
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_trainjob_can_use_a_cluster_runtime() -> None:
    docs = render(kind="trainjob", runtime="torch-distributed")
    assert "TrainingRuntime" not in docs
    assert docs["TrainJob"]["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"


def test_every_run_path_lands_on_the_shared_volume(tmp_path: Path) -> None:
    """An absolute output_dir used to stay as it was: checkpoints went to the pod's disk and died with it."""
    model = tmp_path / "my-model"
    model.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(
        f"output_dir: /data/runs\nmodel: {{path: {model}, tokenizer: HuggingFaceTB/SmolLM2-135M}}\n"
        "data: {path: /srv/train.jsonl, eval_path: evals/dev.jsonl, cache_dir: /tmp/cache, shards_dir: shards}\n"
    )
    cfg = cluster_config(load_config(str(config)))
    assert cfg.output_dir == "/mnt/trainyard/data/runs" and cfg.model.path == f"/mnt/trainyard{model}"
    assert cfg.data.path == "/mnt/trainyard/srv/train.jsonl" and cfg.data.eval_path == "/mnt/trainyard/evals/dev.jsonl"
    assert cfg.data.cache_dir == "/mnt/trainyard/tmp/cache" and cfg.data.shards_dir == "/mnt/trainyard/shards"
    assert cfg.model.tokenizer == "HuggingFaceTB/SmolLM2-135M"  # a hub id, downloaded into HF_HOME on the volume
    assert cfg.model.cache_dir == "/mnt/trainyard/cache/models"


def test_paths_on_the_volume_and_sources_that_are_not_paths_stay() -> None:
    overrides = ["output_dir=/mnt/trainyard/team/runs", "model.cache_dir=/mnt/trainyard/models", "data.path=hf://x/y"]
    cfg = cluster_config(load_config(TINY, overrides))
    assert cfg.output_dir == "/mnt/trainyard/team/runs" and cfg.model.cache_dir == "/mnt/trainyard/models"
    assert cfg.data.path == "hf://x/y" and cfg.model.tokenizer == "builtin:bytes"


def test_the_manifest_says_which_paths_moved_and_what_to_copy() -> None:
    text = render_manifests(load_config(TINY, ["output_dir=/data/runs", "data.eval_path=/srv/dev.jsonl"]),
                            K8sJob(nodes=1, gpus_per_node=0, image="img:1"))
    assert "#   output_dir: /data/runs -> /mnt/trainyard/data/runs\n" in text
    moved = "data.eval_path: /srv/dev.jsonl -> /mnt/trainyard/srv/dev.jsonl (copy it onto the claim as srv/dev.jsonl)"
    assert moved in text
    job = yaml.safe_load(documents(text)["ConfigMap"]["data"]["job.yaml"])
    assert job["output_dir"] == "/mnt/trainyard/data/runs"
    assert job["data"]["eval_path"] == "/mnt/trainyard/srv/dev.jsonl"


@pytest.mark.parametrize("path", ["~/cache", "../shared/cache"])
def test_a_path_that_cannot_be_on_the_volume_is_refused_with_its_line(tmp_path: Path, path: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(f"run_name: tiny\ndata:\n  cache_dir: {path}\n")
    with pytest.raises(ConfigError) as err:
        render_manifests(load_config(str(config)), K8sJob(nodes=1, gpus_per_node=0, image="img:1"))
    assert err.value.where == f"{config}:3" and f"data.cache_dir '{path}'" in err.value.what
    result = run_cli("k8s", str(config), "--image", "img:1", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr and f"{config}:3" in result.stderr


def test_every_form_the_secret_help_shows_is_accepted() -> None:
    help_text = " ".join(run_cli("k8s", "--help").stdout.split())
    assert "WANDB_API_KEY=wandb:api-key" in help_text
    assert {entry["name"] for entry in secret_env(("team-tokens", "WANDB_API_KEY=wandb:api-key"))} == {
        "WANDB_API_KEY",
        "HF_TOKEN",
    }
    with pytest.raises(OptionError) as err:
        secret_env(("WANDB_API_KEY",))  # a variable where the Secret's name belongs
    assert "--secret WANDB_API_KEY=wandb:api-key" in err.value.render()


@pytest.mark.parametrize(("run_name", "name"), [("tiny", "tiny"), ("My_Run.v2", "my-run-v2"), ("x" * 80, "x" * 40)])
def test_names_are_dns_labels(run_name: str, name: str) -> None:
    assert k8s_name(run_name) == name


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"kind": "tfjob"}, "--kind 'tfjob'"),
        ({"image": ""}, "--image"),
        ({"grace_s": 5}, "--grace 5"),
        ({"secrets": ("Bad Name",)}, "--secret 'Bad Name'"),
        ({"nodes": 0}, "--nodes 0"),
        ({"runtime": "torch-distributed"}, "--runtime torch-distributed is for --kind trainjob"),
        ({"pvc": "team", "storage_class": "fast"}, "--storage-class fast"),
    ],
)
def test_bad_options_are_user_errors(options: dict, needle: str) -> None:
    with pytest.raises(OptionError) as err:
        render(**options)
    assert needle in err.value.render()


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_pods_request_the_host_memory_the_estimate_predicts(tmp_path: Path, kind: str) -> None:
    from trainyard.estimate import Hardware, host_memory

    out = tmp_path / "job.yaml"
    result = run_cli("k8s", TINY, f"output_dir={tmp_path}", "--image", "img:1", "--kind", kind, "--nodes", "2",
                     "--gpus-per-node", "8", "--gpu", "h100-80gb", "--out", str(out))
    assert result.returncode == 0, result.stderr
    predicted = host_memory(load_config(TINY, [f"output_dir={tmp_path}"]), Hardware("h100-80gb", 8, 2)).request_gib
    text = out.read_text()
    requests = [doc for doc in yaml.safe_load_all(text) if "memory:" in yaml.safe_dump(doc)]
    assert requests, "no document requests memory"
    assert f"memory: {predicted}Gi" in text and f"requests.memory {predicted}Gi" in text


def test_the_grace_period_is_slurms_signal_lead_for_the_estimated_save_and_grace_wins(tmp_path: Path) -> None:
    """A fixed 300 s grace killed a 70B full save (~420 s estimated) half-way."""
    from tests.unit.launch.test_slurm import LLAMA_70B
    from trainyard.launch.slurm import SHUTDOWN_MARGIN_S as SLURM_MARGIN_S
    from trainyard.launch.slurm import SlurmJob, resolve

    config = tmp_path / "big.yaml"
    config.write_text(LLAMA_70B)
    cfg = load_config(str(config))
    job = with_estimated_grace(K8sJob(nodes=4, gpus_per_node=8, image="img:1"), cfg, "h100-80gb")
    _, lead = resolve(SlurmJob(config=str(config), overrides=(), nodes=4, gpus_per_node=8, gpu="h100-80gb"), cfg)
    assert job.grace_s > 400 and job.grace_s - 15 == lead.seconds - SLURM_MARGIN_S  # the same save window
    text = render_manifests(cfg, job)
    pod = documents(text)["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == job.grace_s
    assert f"--shutdown-timeout {job.grace_s - 15}" in " ".join(pod["containers"][0]["command"])
    assert "estimated by trainyard for 4 x 8 h100-80gb" in text and "--grace N overrides" in text
    estimated = run_cli("k8s", TINY, "--image", "img:1", "--nodes", "2", cwd=tmp_path)
    assert estimated.returncode == 0, estimated.stderr
    assert "terminationGracePeriodSeconds 95: estimated by trainyard for 2 x 1 cpu" in estimated.stderr  # the floor
    given = run_cli("k8s", TINY, "--image", "img:1", "--grace", "600", cwd=tmp_path)
    assert "terminationGracePeriodSeconds: 600" in given.stdout and "600 s: --grace." in given.stdout
