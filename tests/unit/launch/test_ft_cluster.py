"""A fault-tolerant DiLoCo job on clusters: `trainyard slurm` writes one script per site and one for the lighthouse,
`trainyard k8s` one job per site and a Deployment + Service for the lighthouse; each site's command loads as its own
site, told the lighthouse's address. Validation against the schemas is in tests/e2e/test_k8s.py."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY, run_cli
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.launch import ft_cluster, lighthouse
from trainyard.launch.k8s import K8sJob
from trainyard.launch.slurm import SlurmJob, resolve

FT = ("dist.strategy=diloco", "diloco.fault_tolerant=true", "diloco.sites=3")
"""A fault-tolerant job as its file says it: no diloco.site (each site's launch adds its own)."""
LIGHTHOUSE = "diloco.lighthouse=cpu007.cluster.example:29600"


@pytest.fixture(autouse=True)
def _no_lighthouse_in_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)


def slurm_scripts(tmp_path: Path, *overrides: str, **options) -> dict[str, str]:
    overrides = (*FT, *overrides)
    cfg = ft_cluster.load_job(TINY, overrides)
    job, lead = resolve(SlurmJob(config=TINY, overrides=overrides, nodes=2, gpus_per_node=4, workdir=str(tmp_path),
                                 venv="/opt/venv", **options), cfg)
    return {script.role: script.text for script in ft_cluster.slurm_scripts(job, cfg, lead)}


def command_args(text: str, command: str) -> list[str]:
    """CONFIG and the key=value arguments of the script's `trainyard COMMAND` line."""
    line = next(line for line in text.splitlines() if f"trainyard {command} " in line)
    words = shlex.split(line.split(f"trainyard {command} ", 1)[1].rstrip(" \\&"))
    return [word for word in words if not word.startswith("--")]


def test_each_site_has_its_own_script_its_own_rendezvous_and_no_dependency(tmp_path: Path) -> None:
    scripts = slurm_scripts(tmp_path, LIGHTHOUSE)
    assert list(scripts) == ["lighthouse", "site-0", "site-1", "site-2"]
    for site in range(3):
        text = scripts[f"site-{site}"]
        config, *overrides = command_args(text, "launch")
        cfg = load_config(config, overrides)  # what the site's launch reads
        assert cfg.diloco.site == site and cfg.diloco.lighthouse == "cpu007.cluster.example:29600"
        assert cfg.run_dir.name == f"site-{site}" and f"#SBATCH --output={tmp_path / cfg.run_dir}/logs/" in text
        assert f"#SBATCH --job-name=tiny-site-{site}" in text and "#SBATCH --gres=gpu:4" in text
        assert '--rdzv c10d --rdzv-id "$SLURM_JOB_ID" --master "$MASTER_ADDR:$MASTER_PORT"' in text
    assert not any("--dependency" in text or "afterok" in text for text in scripts.values())


def test_the_lighthouse_script_is_a_one_cpu_job_that_restarts_and_requeues_it(tmp_path: Path) -> None:
    text = slurm_scripts(tmp_path, LIGHTHOUSE, time="12:00:00", partition="cpu", cpus_per_task=16)["lighthouse"]
    assert "--gres" not in text and "#SBATCH --ntasks=1" in text and "#SBATCH --cpus-per-task=1 " in text
    assert "#SBATCH --nodelist=cpu007" in text  # the node the sites look for it on
    assert "#SBATCH --requeue" in text and "#SBATCH --time=12:00:00" in text
    assert re.search(r"#SBATCH --signal=B:USR1@\d+", text) and 'scontrol requeue "$SLURM_JOB_ID"' in text
    loop = text[text.index("while true; do"):]
    assert "srun --ntasks=1 trainyard lighthouse" in loop and "sleep" in loop and loop.rstrip().endswith("done")
    assert '"$status" -eq 2' in loop  # a config error is not restarted forever
    config, *overrides = command_args(text, "lighthouse")
    cfg = ft_cluster.load_job(config, overrides)  # as `trainyard lighthouse` reads it: no site needed
    assert "[::]:29600" in lighthouse.command(cfg)
    assert f"#SBATCH --output={tmp_path}/runs/tiny/logs/lighthouse-%j.out" in text


def test_a_lighthouse_given_by_address_is_not_pinned_to_a_node_name(tmp_path: Path) -> None:
    text = slurm_scripts(tmp_path, "diloco.lighthouse=10.1.2.3:29510")["lighthouse"]
    assert "--nodelist=10" not in text and "pin this job to the node that holds it" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_every_script_is_valid_bash(tmp_path: Path) -> None:
    for role, text in slurm_scripts(tmp_path, LIGHTHOUSE).items():
        result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{role}: {result.stderr}"


def test_a_lighthouse_from_the_environment_is_written_into_the_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shell that submits the scripts later may not have TORCHFT_LIGHTHOUSE."""
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://cpu003:29510")
    scripts = slurm_scripts(tmp_path)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    for role in ("lighthouse", "site-1"):
        config, *overrides = command_args(scripts[role], "lighthouse" if role == "lighthouse" else "launch")
        assert ft_cluster.load_job(config, overrides).diloco.lighthouse == "cpu003:29510"


@pytest.mark.parametrize(("overrides", "needles"), [
    ((), ["diloco.lighthouse", "TORCHFT_LIGHTHOUSE", "set diloco.lighthouse: HOST:PORT"]),
    (("diloco.lighthouse=cpu007",), ["diloco.lighthouse 'cpu007' is not HOST:PORT"]),
])
def test_a_site_job_without_a_lighthouse_address_is_exit_2(tmp_path: Path, overrides: tuple, needles: list) -> None:
    result = run_cli("slurm", TINY, *FT, *overrides, "--nodes", "1", "--gpus-per-node", "0", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = " ".join(result.stderr.split())
    for needle in needles:
        assert needle in said
    assert not list(tmp_path.rglob("*.sbatch"))


def test_cli_writes_the_scripts_beside_out_with_their_log_folders_and_says_the_order(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    argv = ["slurm", TINY, *FT, LIGHTHOUSE, f"output_dir={tmp_path / 'runs'}", "--nodes", "1", "--gpus-per-node", "0",
            "--out", str(out)]
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written = [tmp_path / f"job-{role}.sbatch" for role in ("lighthouse", "site-0", "site-1", "site-2")]
    assert result.stdout.split() == [str(path) for path in written] and all(path.is_file() for path in written)
    assert (tmp_path / "runs/tiny/logs").is_dir() and (tmp_path / "runs/tiny/site-2/logs").is_dir()
    said = " ".join(result.stderr.split())
    assert said.index("job-lighthouse.sbatch first") < said.index("job-site-0.sbatch on site 0's cluster")
    again = run_cli(*argv, cwd=tmp_path)
    assert again.returncode == 2 and "job-lighthouse.sbatch already exists" in " ".join(again.stderr.split())


def test_reading_a_job_without_its_site() -> None:
    assert ft_cluster.load_job(TINY, FT).diloco.site == 0
    assert ft_cluster.load_job(TINY, ()).diloco.site is None  # not fault-tolerant: read as it is
    with pytest.raises(ConfigError) as err:
        ft_cluster.load_job(TINY, FT[:2])  # no diloco.sites: said on the user's own text
    assert "diloco.sites" in err.value.render() and "diloco.site=0" not in err.value.render()


def test_the_lighthouse_waits_for_a_slow_site_as_long_as_the_job_says() -> None:
    """Sites of unequal speed: past diloco.join_timeout_s the sites present sync without the slow one."""
    waits = [lighthouse.command(ft_cluster.load_job(TINY, (*FT, LIGHTHOUSE, *extra)))
             for extra in ((), ("diloco.join_timeout_s=900",))]
    assert [w[w.index("--join_timeout_ms") + 1] for w in waits] == ["60000", "900000"]


def test_a_join_timeout_the_quorum_timeout_would_cut_short_is_exit_2(tmp_path: Path) -> None:
    result = run_cli("lighthouse", TINY, *FT, "diloco.site=0", LIGHTHOUSE, "diloco.join_timeout_s=600",
                     "diloco.quorum_timeout_s=300",
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "diloco.join_timeout_s (600) must be below diloco.quorum_timeout_s (300)" in result.stderr
    assert "Traceback" not in result.stderr


def k8s_documents(kind: str = "pytorchjob", *overrides: str) -> list[dict]:
    cfg = ft_cluster.load_job(TINY, (*FT, *overrides))
    job = K8sJob(nodes=2, gpus_per_node=8, image="img:1", kind=kind, namespace="ml")
    return list(yaml.safe_load_all(ft_cluster.render_manifests(cfg, job)))


def pod_job(config_map: dict, tmp_path: Path, command: list[str], loader=load_config):
    """The job a pod's command reads: the ConfigMap's file, with the key=value arguments after it."""
    path = tmp_path / "job.yaml"
    path.write_text(config_map["data"]["job.yaml"])
    return loader(str(path), [word for word in command[3:] if "=" in word and not word.startswith("--")])


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_k8s_writes_one_job_per_site_told_the_lighthouse_services_address(tmp_path: Path, kind: str) -> None:
    docs = k8s_documents(kind, LIGHTHOUSE)
    by_kind = {doc["kind"]: doc for doc in docs}
    service = by_kind["Service"]
    meta, port = service["metadata"], service["spec"]["ports"][0]["port"]
    address = f"{meta['name']}.{meta['namespace']}.svc:{port}"
    assert address == "tiny-lighthouse.ml.svc:29600"  # the port of diloco.lighthouse; its host becomes the Service
    jobs = [doc for doc in docs if doc["kind"] == ("PyTorchJob" if kind == "pytorchjob" else "TrainJob")]
    assert [job["metadata"]["name"] for job in jobs] == ["tiny-site-0", "tiny-site-1", "tiny-site-2"]
    for site, job in enumerate(jobs):
        if kind == "pytorchjob":
            pods = [spec["template"]["spec"] for spec in job["spec"]["pytorchReplicaSpecs"].values()]
            commands = [pod["containers"][0]["command"] for pod in pods]
        else:
            assert job["spec"]["runtimeRef"]["name"] == "tiny-runtime"  # one runtime for every site
            commands = [job["spec"]["trainer"]["command"]]
        for command in commands:
            cfg = pod_job(by_kind["ConfigMap"], tmp_path, command)
            assert cfg.diloco.site == site and cfg.diloco.lighthouse == address
    assert len([doc for doc in docs if doc["kind"] == "TrainingRuntime"]) == (kind == "trainjob")


def test_k8s_lighthouse_is_one_restarting_replica_that_the_service_selects(tmp_path: Path) -> None:
    by_kind = {doc["kind"]: doc for doc in k8s_documents()}
    deployment, service = by_kind["Deployment"], by_kind["Service"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["restartPolicy"] == "Always" and "nvidia.com/gpu" not in str(container["resources"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert container["livenessProbe"]["tcpSocket"]["port"] in ports and container["readinessProbe"]
    assert service["spec"]["ports"][0]["targetPort"] in ports
    cfg = pod_job(by_kind["ConfigMap"], tmp_path, container["command"], ft_cluster.load_job)
    assert f"[::]:{ports['lighthouse']}" in lighthouse.command(cfg)  # it listens where the probes and Service look
    assert ports["lighthouse"] == ft_cluster.DEFAULT_PORT  # no diloco.lighthouse: torchft's port
