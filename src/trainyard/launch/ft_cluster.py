"""A fault-tolerant DiLoCo job on clusters: one job per site, and the torchft lighthouse on its own.

Each site of such a job is its own launch and its own torch world, often on its own cluster, and the lighthouse
must outlive every one of them (launch/lighthouse.py). So `trainyard slurm` writes one batch script per site (the
site baked in as diloco.site=S, its own rendezvous inside its own allocation) and one for the lighthouse: a
one-CPU job that restarts it whenever it dies and requeues itself; no site depends on it. `trainyard k8s` writes
a Deployment and a Service for the lighthouse and one training job per site, which reaches it by the Service's
DNS name. Sites that lose the lighthouse train their rounds alone and re-join once it is back (diloco/ft.py).
"""

from __future__ import annotations

import ipaddress
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainyard.config import JobConfig
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.launch import k8s
from trainyard.launch.slurm import SlurmJob, render_sbatch, shell_setup
from trainyard.launch.stop_lead import SignalLead
from trainyard.runs import layout as run_layout

DEFAULT_PORT = 29510
"""torchft's lighthouse port, where a Kubernetes job's diloco.lighthouse names none."""
REQUEUE_LEAD_S = 60
"""The lighthouse job requeues itself this long before its time limit: a minute is plenty for a quorum server."""
RESTART_PAUSE_S = 5
"""Between a lighthouse that ended and its restart: a crash loop stays readable in the log."""
USER_ERROR_EXIT_CODE = 2


def load_job(path: str, overrides: list[str] | tuple[str, ...]) -> JobConfig:
    """The job as the generators and the lighthouse read it. A fault-tolerant job's file names no site (each site's
    launch adds its own diloco.site), so it is read as site 0's; errors are reported on the user's own text."""
    try:
        cfg = load_config(path, [*overrides, "diloco.site=0"])
    except ConfigError:
        return load_config(path, overrides)
    return cfg if cfg.diloco.fault_tolerant else load_config(path, overrides)


def sites(cfg: JobConfig) -> int:
    assert cfg.diloco.sites is not None  # the config's validator holds it for a fault-tolerant job
    return cfg.diloco.sites


def as_site(cfg: JobConfig, site: int | None) -> JobConfig:
    return cfg.model_copy(update={"diloco": cfg.diloco.model_copy(update={"site": site})})


def job_root(cfg: JobConfig) -> Path:
    """The run dir every site's own run dir (site-S) sits in: the lighthouse logs here."""
    return Path(cfg.output_dir) / cfg.run_name


def lighthouse_address(cfg: JobConfig) -> tuple[str, int]:
    """HOST and PORT of the lighthouse every site asks for its quorum: diloco.lighthouse, else TORCHFT_LIGHTHOUSE."""
    address = cfg.diloco.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise ConfigError(
            "diloco.fault_tolerant: every site must be told where the lighthouse runs, and neither "
            "diloco.lighthouse nor TORCHFT_LIGHTHOUSE is set",
            where=cfg.where("diloco.lighthouse"),
            fix="set diloco.lighthouse: HOST:PORT, the node of the cluster that runs the lighthouse's script (e.g. "
            f"cpu001:{DEFAULT_PORT}), at an address every site can reach",
        )
    parsed = urlparse(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise ConfigError(
            f"diloco.lighthouse {address!r} is not HOST:PORT",
            where=cfg.where("diloco.lighthouse"),
            fix=f"write it as HOST:PORT, e.g. cpu001:{DEFAULT_PORT}",
        )
    return parsed.hostname, port


def _baked_lighthouse(cfg: JobConfig) -> tuple[str, ...]:
    """An address read from TORCHFT_LIGHTHOUSE here goes into the scripts: the shell that submits them may not
    have it."""
    if cfg.diloco.lighthouse:
        return ()
    host, port = lighthouse_address(cfg)
    return (f"diloco.lighthouse={host}:{port}",)


# ---------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class Script:
    role: str
    """lighthouse, or site-S."""
    text: str
    log_dir: Path
    """Where its Slurm log goes: sbatch does not create it."""


def script_path(base: Path, role: str) -> Path:
    """job.sbatch -> job-lighthouse.sbatch, job-site-0.sbatch, ..."""
    return base.with_name(f"{base.stem}-{role}{base.suffix or '.sbatch'}")


def _slurm_node(host: str) -> str | None:
    """The Slurm node a lighthouse host names: its first label (node names are short); None for an address."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host.split(".")[0]
    return None


def site_about(cfg: JobConfig, site: int) -> tuple[str, ...]:
    host, port = lighthouse_address(cfg)
    return (
        f"Fault-tolerant DiLoCo: site {site} of {sites(cfg)} (diloco.site={site}), its own job and torch world.",
        f"Submit it on site {site}'s cluster, in any order with the others: it asks the lighthouse at {host}:{port}",
        "for a quorum at each outer sync, and trains its rounds alone while it cannot reach it (no dependency).",
        "Other sites reach this one at its first node's address (the torchft manager and the cross-site group meet",
        "there): with sites on other clusters, pass --nic so it is an address they route to.",
    )


def site_scripts(job: SlurmJob, cfg: JobConfig, lead: SignalLead) -> list[Script]:
    """One batch script per site: the job's own script (its rendezvous inside its own allocation) with the site."""
    scripts = []
    for site in range(sites(cfg)):
        site_cfg = as_site(cfg, site)
        site_job = replace(job, name=f"{cfg.run_name}-site-{site}",
                           overrides=(*job.overrides, *_baked_lighthouse(cfg), f"diloco.site={site}"))
        text = render_sbatch(site_job, site_cfg, lead, about=site_about(cfg, site))
        scripts.append(Script(f"site-{site}", text, Path(job.workdir) / site_cfg.run_dir / run_layout.LOGS))
    return scripts


def _lighthouse_sbatch_lines(job: SlurmJob, cfg: JobConfig, log_dir: Path) -> list[str]:
    host, port = lighthouse_address(cfg)
    node = _slurm_node(host)
    pin = (
        [f"#SBATCH --nodelist={node}   # the node diloco.lighthouse names: every site looks for it there"]
        if node
        else [f"# diloco.lighthouse names an address ({host}): pin this job to the node that holds it",
              "# (#SBATCH --nodelist=NODE), or the lighthouse runs where no site looks for it."]
    )
    optional = (("time", job.time), ("partition", job.partition), ("account", job.account))
    return [
        f"#SBATCH --job-name={cfg.run_name}-lighthouse",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=1               # a quorum server: one CPU, no GPU, little memory",
        "#SBATCH --mem=1G",
        *pin,
        *(f"#SBATCH --{name}={value}" for name, value in optional if value is not None),
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={log_dir}/lighthouse-%j.out   # a requeued run appends",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{REQUEUE_LEAD_S}          # to this shell, before the time limit: requeue",
        "#SBATCH --requeue                       # and after a node failure",
    ]


def lighthouse_script(job: SlurmJob, cfg: JobConfig) -> Script:
    """The lighthouse's own job: `trainyard lighthouse` as a Slurm step, restarted whenever it ends (but on a
    config error, which a restart repeats), the job requeued before its time limit and after a node failure."""
    host, port = lighthouse_address(cfg)
    log_dir = Path(job.workdir) / job_root(cfg) / run_layout.LOGS
    args = shlex.join([job.config, *job.overrides, *_baked_lighthouse(cfg)])
    header = [
        "#!/bin/bash",
        f"# trainyard job '{cfg.run_name}': the torchft lighthouse of its {sites(cfg)} fault-tolerant DiLoCo sites, "
        "written by `trainyard slurm`.",
        f"# Submit it first (sbatch THIS_FILE) on the cluster of {host}: every site asks it for a quorum at",
        f"# {host}:{port} (diloco.lighthouse). No site waits for it: a site that cannot reach it takes its outer steps",
        "# alone and re-joins once it is back. So this job restarts it whenever it dies and requeues itself before",
        "# its time limit and after a node failure; it holds no training state: scancel it once every site is done.",
        f"# The log folder must exist before sbatch: mkdir -p {log_dir}",
        "#",
    ]
    setup = shell_setup(job)
    run = [
        "requeue() {",
        '  echo "trainyard: the time limit is near: requeueing the lighthouse (job $SLURM_JOB_ID)"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "}",
        "trap requeue USR1",
        "",
        f"# Restart the lighthouse whenever it ends, but on a config error (exit {USER_ERROR_EXIT_CODE}), which a "
        "restart would repeat.",
        "while true; do",
        f"  srun --ntasks=1 trainyard lighthouse {args} &",
        '  wait "$!"',
        "  status=$?",
        f'  if [ "$status" -eq {USER_ERROR_EXIT_CODE} ]; then',
        '    echo "trainyard: the lighthouse refused its job (exit 2): fix it and submit again" >&2',
        f"    exit {USER_ERROR_EXIT_CODE}",
        "  fi",
        f'  echo "trainyard: the lighthouse exited with $status; restarting it in {RESTART_PAUSE_S} s '
        '(the sites go on alone meanwhile)"',
        f"  sleep {RESTART_PAUSE_S}",
        "done",
    ]
    blocks = [header + _lighthouse_sbatch_lines(job, cfg, log_dir), setup, run]
    return Script("lighthouse", "\n\n".join("\n".join(block) for block in blocks) + "\n", log_dir)


def slurm_scripts(job: SlurmJob, cfg: JobConfig, lead: SignalLead) -> list[Script]:
    """The lighthouse's script first (submit it first), then each site's."""
    return [lighthouse_script(job, cfg), *site_scripts(job, cfg, lead)]


def submit_order(cfg: JobConfig, paths: list[Path]) -> str:
    host, port = lighthouse_address(cfg)
    lines = [f"fault-tolerant DiLoCo: {sites(cfg)} site(s) and their lighthouse, each its own Slurm job "
             "(no site waits for the lighthouse):",
             f"  sbatch {paths[0]}   first, on the cluster of {host} (the sites reach it at {host}:{port})"]
    lines += [f"  sbatch {path}   on site {site}'s cluster" for site, path in enumerate(paths[1:])]
    lines.append("Sites that start before the lighthouse train alone and join it once it is up; "
                 "scancel the lighthouse once every site has finished.")
    return "\n".join(lines)


# ---------------------------------------------------------------- Kubernetes


def k8s_port(cfg: JobConfig) -> int:
    """The lighthouse's port: diloco.lighthouse's (or TORCHFT_LIGHTHOUSE's) where given; its host becomes the
    Service's name."""
    if cfg.diloco.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"):
        return lighthouse_address(cfg)[1]
    return DEFAULT_PORT


def service_address(name: str, namespace: str, port: int) -> str:
    return f"{name}-lighthouse.{namespace}.svc:{port}"


def _lighthouse_labels(name: str) -> dict[str, str]:
    return {**k8s.labels(name), "app.kubernetes.io/component": "lighthouse"}


def lighthouse_service(name: str, namespace: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-lighthouse", "namespace": namespace, "labels": _lighthouse_labels(name)},
        "spec": {
            "selector": _lighthouse_labels(name),
            "ports": [{"name": "lighthouse", "port": port, "targetPort": "lighthouse", "protocol": "TCP"}],
        },
    }


def lighthouse_deployment(name: str, job: k8s.K8sJob, port: int) -> dict[str, Any]:
    """One replica, restarted whenever it dies or stops answering on its port; Recreate: never two lighthouses,
    whose quorums would split the sites."""
    probe = {"tcpSocket": {"port": "lighthouse"}, "periodSeconds": 10}
    container = {
        "name": "lighthouse",
        "image": job.image,
        "command": ["trainyard", "lighthouse", k8s.CONFIG_FILE],
        "ports": [{"name": "lighthouse", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "initialDelaySeconds": 15, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "job-config", "mountPath": k8s.CONFIG_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{name}-lighthouse", "namespace": job.namespace, "labels": _lighthouse_labels(name)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _lighthouse_labels(name)},
            "template": {
                "metadata": {"labels": _lighthouse_labels(name)},
                "spec": {
                    "restartPolicy": "Always",
                    "containers": [container],
                    "volumes": [{"name": "job-config", "configMap": {"name": f"{name}-config"}}],
                },
            },
        },
    }


def _site_job(name: str, cfg: JobConfig, job: k8s.K8sJob, site: int) -> dict[str, Any]:
    """The job's PyTorchJob or TrainJob under the site's name, with diloco.site on its pods' command line; the
    ConfigMap, claim and runtime stay the job's."""
    site_job = replace(job, overrides=(*job.overrides, f"diloco.site={site}"))
    build = k8s.pytorchjob if job.kind == "pytorchjob" else k8s.trainjob
    obj = build(name, cfg, site_job)
    obj["metadata"]["name"] = f"{name}-site-{site}"
    return obj


def _notes(cfg: JobConfig, address: str) -> dict[str, str]:
    root = k8s.cluster_config(cfg).output_dir + f"/{cfg.run_name}"
    return {
        "pvc": f"""
Checkpoints, each site's run dir and the data/model caches: ReadWriteMany, so every node of a site reads and
writes the same run dir ({job_root(cfg)}/site-S becomes {root}/site-S; sites on one cluster share the claim).
`trainyard status` on any pod that mounts it shows progress.""",
        "deployment": f"""
The torchft lighthouse of the job's {sites(cfg)} fault-tolerant DiLoCo sites, on its own: one replica, restarted
by the kubelet whenever it ends (restartPolicy Always) or its port stops answering (livenessProbe); strategy
Recreate, so two never run at once. No site waits for it: a site that cannot reach it takes its outer steps
alone and re-joins once it is back. It holds no training state: delete it once every site has finished.""",
        "service": f"""
The sites reach the lighthouse at {address} (diloco.lighthouse in the job file above).
Sites in another cluster: expose it (type LoadBalancer) and set diloco.lighthouse to that address there.""",
        "site": """
Site {site} of {sites} (diloco.site={site} on its command line): its own job and torch world, its own run dir
({run_dir}); it trains its rounds alone while the others or the lighthouse are gone.""",
    }


def render_manifests(cfg: JobConfig, job: k8s.K8sJob) -> str:
    """The job's documents (`k8s.render_manifests`) for a fault-tolerant DiLoCo job: the ConfigMap (the lighthouse
    at its Service's address), the claim, the lighthouse's Service and Deployment, then one job per site."""
    k8s.check_options(job)
    name = k8s.k8s_name(cfg.run_name)
    address = service_address(name, job.namespace, k8s_port(cfg))
    diloco = cfg.diloco.model_copy(update={"site": None, "lighthouse": address})  # each pod's command adds its site
    pod_cfg = k8s.cluster_config(cfg).model_copy(update={"diloco": diloco})
    notes = {**k8s.comments(name, cfg, job), **_notes(cfg, address)}
    documents = [k8s.document(notes["config"], k8s.config_map(name, job.namespace, pod_cfg))]
    if job.pvc is None:
        documents.append(k8s.document(notes["pvc"], k8s.volume_claim(name, job)))
    documents.append(k8s.document(notes["service"], lighthouse_service(name, job.namespace, k8s_port(cfg))))
    documents.append(k8s.document(notes["deployment"], lighthouse_deployment(name, job, k8s_port(cfg))))
    if job.kind == "trainjob" and job.runtime is None:
        documents.append(k8s.document(notes["runtime"], k8s.training_runtime(name, job)))
    for site in range(sites(cfg)):
        run_dir = as_site(pod_cfg, site).run_dir
        about = notes["site"].format(site=site, sites=sites(cfg), run_dir=run_dir)
        documents.append(k8s.document(about + notes[job.kind], _site_job(name, pod_cfg, job, site)))
    header = (
        f"# trainyard job '{cfg.run_name}' for Kubernetes: {sites(cfg)} fault-tolerant DiLoCo site(s) and their "
        "lighthouse, written by `trainyard k8s`. Apply with: kubectl apply -f THIS_FILE\n"
    )
    return header + "---\n".join(documents)
