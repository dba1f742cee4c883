"""`trainyard slurm`: the sbatch script's shape, its requeue rule, and what it never contains."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, run_cli
from trainyard.config_file import load_config
from trainyard.errors import ConfigError, OptionError
from trainyard.launch.slurm import SlurmJob, render_sbatch, resolve, sinfo_gpu_kind, sinfo_node_shape, time_limit_s
from trainyard.network import network_env

LLAMA_70B = """\
run_name: big
model:
  config: {model_type: llama, hidden_size: 8192, intermediate_size: 28672, num_hidden_layers: 80,
           num_attention_heads: 64, num_key_value_heads: 8, vocab_size: 128256}
  tokenizer: builtin:bytes
lora: {enabled: false}
data: {max_length: 4096}
train: {micro_batch_size: 1}
dist: {strategy: fsdp}
"""


def render(tmp_path: Path, overrides: tuple[str, ...] = (), **options) -> str:
    options.setdefault("nodes", 2)
    options.setdefault("gpus_per_node", 8)
    job = SlurmJob(config=TINY, overrides=overrides, workdir=str(tmp_path), **options)
    return render_sbatch(job, load_config(TINY, list(overrides)))


def test_gpu_script_runs_one_launcher_per_node_with_c10d(tmp_path: Path) -> None:
    text = render(
        tmp_path,
        ("train.max_steps=5",),
        partition="gpu",
        time="24:00:00",
        account="proj",
        mem="0",
        cpus_per_task=16,
        venv="/opt/venv",
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=24:00:00",
        "#SBATCH --account=proj",
        "#SBATCH --mem=0",
        "#SBATCH --cpus-per-task=16",
    ]:
        assert line in text, line
    assert "#SBATCH --ntasks-per-node=1" in text
    assert 'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c run_node' in text
    assert "--exclusive" not in text
    assert f"trainyard launch {TINY} train.max_steps=5" in text
    assert '--node-rank "$SLURM_NODEID" --nproc 8' in text
    assert '--rdzv c10d --rdzv-id "$SLURM_JOB_ID" --master "$MASTER_ADDR:$MASTER_PORT"' in text
    assert text.count("source /opt/venv/bin/activate") == 2  # the batch shell and every node


def test_preemption_signal_and_requeue_on_75(tmp_path: Path) -> None:
    text = render(tmp_path)
    assert "#SBATCH --signal=USR1@90" in text and "#SBATCH --requeue" in text
    branch = text[text.index('if [ "$status" -eq 75 ]') :]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in branch.split("fi")[0]
    assert text.rstrip().endswith('exit "$status"')
    assert "--shutdown-timeout 80" in text  # the workers' save ends before Slurm's kill


def test_per_job_log_in_the_run_dir(tmp_path: Path) -> None:
    text = render(tmp_path)
    assert f"#SBATCH --output={tmp_path}/runs/tiny/logs/slurm-%j.out" in text
    assert "#SBATCH --open-mode=append" in text


def test_cpu_only_cluster_takes_nproc_from_option_and_no_gres(tmp_path: Path) -> None:
    text = render(tmp_path, gpus_per_node=0, nproc_per_node=3)
    assert "--gres" not in text and "--nproc 3" in text


def test_network_preset_exported_unless_the_user_set_it(tmp_path: Path) -> None:
    text = render(tmp_path, ("dist.network=socket",), nic="eth0")
    assert 'export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"' in text
    assert 'export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-eth0}"' in text
    assert "MASTER_ADDR=$(ip -4 -o addr show dev eth0" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_config_network_reaches_the_environment_srun_passes_on(tmp_path: Path) -> None:
    """dist.network and dist.nic from the config alone (no --nic): every variable is exported
    before srun starts the nodes, and one the user exported before sbatch keeps its value."""
    text = render(tmp_path, ("dist.network=wan", "dist.nic=eth0"))
    exports = [line for line in text.splitlines() if line.startswith("export ") and ":-" in line]
    assert text.index(exports[-1]) < text.index("srun --ntasks-per-node=1")
    shell = "\n".join([*exports, "env"])
    user_env = {"PATH": "/usr/bin:/bin", "NCCL_SOCKET_IFNAME": "ib0"}
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True, env=user_env)
    seen = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    for name, value in network_env("wan", "eth0").items():
        assert seen[name] == ("ib0" if name == "NCCL_SOCKET_IFNAME" else value), name


def test_without_nic_the_head_is_the_first_node_by_name(tmp_path: Path) -> None:
    text = render(tmp_path)
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text


def test_secrets_stay_in_the_env_file(tmp_path: Path) -> None:
    secret = "wandb-v1-plantedSECRETvalue42"
    env_file = tmp_path / "tokens.env"
    env_file.write_text(f"WANDB_API_KEY={secret}\n")
    text = render(tmp_path, env_file=str(env_file))
    assert f"set -a; source {env_file}; set +a" in text
    assert secret not in text


def test_secret_in_an_override_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = "hf_plantedTOKENinOverride77"
    monkeypatch.setenv("HF_TOKEN", planted)
    for override in (f"data.path=/data/{planted}/train.jsonl", "model.config.api_key=abc123456"):
        with pytest.raises(ConfigError, match="--env-file"):
            render(tmp_path, (override,))


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_script_is_valid_bash(tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    env_file = tmp_path / "tokens.env"
    env_file.write_text("HF_TOKEN=x\n")
    script.write_text(render(tmp_path, ("dist.network=wan",), nic="eth0", env_file=str(env_file), venv="/opt/v"))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"nodes": 0}, "--nodes 0"),
        ({"env_file": "/no/such/tokens.env"}, "--env-file /no/such/tokens.env"),
        ({"gpus_per_node": -1}, "--gpus-per-node -1"),
        ({"partition": "gpu; rm -rf /"}, "--partition"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0"),
        ({"signal_lead": 10}, "--signal-lead 10"),
        ({"cpus_per_task": 0}, "--cpus-per-task 0"),
        ({"gpu": "tpu-v9"}, "--gpu tpu-v9"),
    ],
)
def test_bad_options_are_user_errors(tmp_path: Path, options: dict, needle: str) -> None:
    with pytest.raises(OptionError) as err:
        render(tmp_path, **options)
    assert needle in err.value.render()


def test_cli_writes_the_script_and_its_log_folder(tmp_path: Path) -> None:
    out = tmp_path / "job.sbatch"
    result = run_cli(
        "slurm",
        TINY,
        f"output_dir={tmp_path / 'runs'}",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --gres=gpu:4" in out.read_text()
    assert (tmp_path / "runs" / "tiny" / "logs").is_dir()  # sbatch would not create it, and would log nothing


def test_a_diloco_job_across_four_sites_is_written_with_one_launcher_per_site(tmp_path: Path) -> None:
    """Seed 003's four sites: one node each, so diloco.groups node makes each node a site of 4 ranks."""
    config = str(REPO / "configs" / "scratch-1.5b.yaml")
    result = run_cli("slurm", config, "--nodes", "4", "--gpus-per-node", "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=4" in result.stdout and f"trainyard launch {config}" in result.stdout
    assert '--node-rank "$SLURM_NODEID" --nproc 4' in result.stdout


def test_without_cpus_per_task_each_node_is_taken_whole_and_srun_passes_its_cpus_on(tmp_path: Path) -> None:
    """Slurm's default is 1 CPU per task: the launcher and all its workers would share one core."""
    text = render(tmp_path)
    assert "#SBATCH --exclusive" in text and "--cpus-per-task=" not in text.split("srun")[0]
    assert 'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c run_node' in text


def test_a_missing_gpus_per_node_is_exit_2_not_a_cpu_only_job(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="--gpus-per-node is missing") as err:
        render(tmp_path, gpus_per_node=None)
    assert "--gpus-per-node 0 for CPU-only nodes" in err.value.render()
    result = run_cli("slurm", TINY, "--nodes", "2", cwd=tmp_path)
    assert result.returncode == 2 and "--gpus-per-node N" in result.stderr and "Traceback" not in result.stderr


def test_sinfo_node_shape_is_the_smallest_node_of_the_partition() -> None:
    text = "64 gpu:h100:8(S:0-1)\n48 gpu:h100:8(S:0-1),shard:16\n64 gpu:4,gpu:a100:2\n"
    assert sinfo_node_shape(text) == (48, 6)
    assert sinfo_node_shape("16 (null)\n") == (16, 0)


def test_small_job_keeps_the_floor_and_says_where_the_lead_came_from(tmp_path: Path) -> None:
    text = render(tmp_path, gpus_per_node=0, nproc_per_node=2)
    assert "#SBATCH --signal=USR1@90" in text and "--shutdown-timeout 80" in text
    assert "estimated by trainyard for 2 x 2 cpu" in text and "--signal-lead N overrides" in text


def test_signal_lead_covers_the_estimated_full_save_of_a_70b_model(tmp_path: Path) -> None:
    """The fixed 90 s lead gave a 70B job 80 s to write a checkpoint that takes 423 s: it was killed mid-save."""
    from trainyard.estimate import Hardware, estimate

    config = tmp_path / "big.yaml"
    config.write_text(LLAMA_70B)
    cfg = load_config(str(config))
    job = SlurmJob(config=str(config), overrides=(), nodes=4, gpus_per_node=8, gpu="h100-80gb")
    timing = estimate(cfg, Hardware("h100-80gb", 8, 4), suggest=False).timing
    _, lead = resolve(job, cfg)
    assert timing.save_s > 400 and lead.save_window_s > timing.save_s + timing.step_s
    text = render_sbatch(job, cfg)
    assert f"#SBATCH --signal=USR1@{lead.seconds}" in text and f"--shutdown-timeout {lead.save_window_s}" in text
    assert f"a full save {timing.save_s:.3g} s" in text


def test_signal_lead_flag_overrides_the_estimate(tmp_path: Path) -> None:
    text = render(tmp_path, signal_lead=1200)
    assert "#SBATCH --signal=USR1@1200" in text and "--shutdown-timeout 1190" in text
    assert "1200 s: --signal-lead." in text


def test_under_diloco_the_lead_covers_the_steps_to_the_rounds_outer_sync(tmp_path: Path) -> None:
    """DiLoCo's sites agree on a stop only at the outer sync: the save can wait up to sync_every steps."""
    from trainyard.estimate import Hardware, estimate

    scratch = str(REPO / "configs" / "scratch-1.5b.yaml")
    cfg = load_config(scratch)
    job = SlurmJob(config=scratch, overrides=(), nodes=4, gpus_per_node=4, gpu="h100-80gb")
    timing = estimate(cfg, Hardware("h100-80gb", 4, 4), suggest=False).timing
    _, lead = resolve(job, cfg)
    assert lead.save_window_s > cfg.diloco.sync_every * timing.step_s + timing.save_s
    assert f"{cfg.diloco.sync_every} steps (to the round's outer sync)" in render_sbatch(job, cfg)


# `sinfo --noheader --Node --partition P --format '%c %G'` from slurmctld (Debian's slurm-wlm 22.05), partitions of
# nodes configured with these Gres= lines; the last is the one-node cluster of tests/e2e/test_slurm.py.
SINFO = {
    "h100": "64 gpu:h100:8\n64 gpu:h100:8\n",
    "nvml names": "48 gpu:nvidia_a100-sxm4-80gb:8\n",
    "no type": "32 gpu:4\n",
    "mixed": "64 gpu:h100:8\n48 gpu:nvidia_a100-sxm4-80gb:8\n",
    "no gpus": "2 (null)\n",
}


def test_the_gpu_kind_is_read_from_the_gres_type_and_never_guessed() -> None:
    assert sinfo_gpu_kind(SINFO["h100"]) == "h100-80gb"
    assert sinfo_gpu_kind(SINFO["nvml names"]) == "a100-80gb"
    assert sinfo_gpu_kind("64 gpu:h100:8(S:0-1)\n48 gpu:h100:8(S:0-1),shard:16\n") == "h100-80gb"
    for untold in ("no type", "mixed", "no gpus"):
        assert sinfo_gpu_kind(SINFO[untold]) is None, untold
    assert sinfo_gpu_kind("64 gpu:h100:8\n64 gpu:4\n") is None  # one node's GPUs have no type


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [("90", 5400), ("1:30", 90), ("01:00:00", 3600), ("2-0", 172800), ("2-3:04", 183840), ("2-3:04:05", 183845),
     ("UNLIMITED", None), ("infinite", None)],
)
def test_time_limits_read_as_sbatch_reads_them(limit: str, seconds: int | None) -> None:
    assert time_limit_s(limit) == seconds


def test_a_time_limit_shorter_than_the_signal_lead_and_a_step_is_refused(tmp_path: Path) -> None:
    """SIGUSR1 would come before the first step ended: the job would save, requeue and never train."""
    config = tmp_path / "big.yaml"
    config.write_text(LLAMA_70B)
    cfg = load_config(str(config))
    job = SlurmJob(config=str(config), overrides=(), nodes=4, gpus_per_node=8, gpu="h100-80gb")
    _, lead = resolve(job, cfg)
    assert lead.step_s is not None and lead.step_s > 1
    short = f"{(lead.seconds + int(lead.step_s) // 2) // 60}:{(lead.seconds + int(lead.step_s) // 2) % 60:02d}"
    with pytest.raises(OptionError) as err:
        resolve(replace(job, time=short), cfg)
    said = " ".join(err.value.render().split())
    assert f"--time {short}" in said and f"the signal's lead {lead.seconds} s plus one step" in said
    enough = lead.seconds + int(lead.step_s) + 2
    resolve(replace(job, time=f"{enough // 60}:{enough % 60:02d}"), cfg)
    result = run_cli("slurm", TINY, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2", "--time", "1:00",
                     "--signal-lead", "200", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--time 1:00 (60 s) is shorter than the signal's lead 200 s" in " ".join(result.stderr.split())
    bad = run_cli("slurm", TINY, "--nodes", "1", "--gpus-per-node", "0", "--time", "1h", cwd=tmp_path)
    assert bad.returncode == 2 and "--time 1h is not a Slurm time limit" in bad.stderr
