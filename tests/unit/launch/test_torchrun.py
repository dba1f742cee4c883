"""`trainyard launch`: where values come from, the torchrun command, exit codes and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli
from trainyard.config import DistConfig
from trainyard.errors import ConfigError
from trainyard.launch.torchrun import (
    describe_launch,
    first_host,
    first_reported_failure,
    network_settings,
    resolve_plan,
    run_torchrun,
    split_host_port,
    torchrun_argv,
)


def test_static_command_is_one_line_per_node_from_flags() -> None:
    plan = resolve_plan(nnodes="2", node_rank=1, master="10.11.7.50:29600", nproc="8", env={})
    argv = torchrun_argv(plan, "job.yaml", ["train.lr=1e-4"])
    assert argv[1:3] == ["-m", "trainyard.launch.agent"]  # torchrun's flags, its agent without the traceback
    assert {
        "--nnodes=2",
        "--nproc-per-node=8",
        "--node-rank=1",
        "--master-addr=10.11.7.50",
        "--master-port=29600",
    } <= set(argv)
    assert argv[-5:] == ["-m", "trainyard.cli", "train", "job.yaml", "train.lr=1e-4"]
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in argv


def test_single_node_with_a_master_is_node_rank_0_without_being_told() -> None:
    argv = torchrun_argv(resolve_plan(nnodes="1", master="10.11.7.50:29600", nproc="2", env={}), "job.yaml", [])
    assert "--node-rank=0" in argv and "--master-addr=10.11.7.50" in argv


def test_single_node_without_master_runs_standalone() -> None:
    argv = torchrun_argv(resolve_plan(nproc="2", env={}), "job.yaml", [])
    assert "--standalone" in argv and "--nnodes=1" in argv


def test_kubeflow_pet_variables_fill_what_flags_leave_open() -> None:
    env = {
        "PET_NNODES": "4",
        "PET_NODE_RANK": "3",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
        "PET_NPROC_PER_NODE": "8",
    }
    plan = resolve_plan(env=env)
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port, plan.nproc) == (
        "4",
        3,
        "job-master-0",
        23456,
        "8",
    )
    assert "--node-rank from PET_NODE_RANK" in describe_launch(plan)
    assert resolve_plan(node_rank=0, env=env).node_rank == 0  # a flag wins over the environment


def test_slurm_variables_and_first_node_of_the_nodelist() -> None:
    env = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "4242"}
    plan = resolve_plan(nproc="4", rdzv="c10d", env=env)
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.rdzv_id) == ("3", 2, "gpu07", "4242")
    assert "is_host=0" in plan.rdzv_conf  # node 2 does not host the rendezvous store


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("gpu[07-09,12],cpu1", "gpu07"), ("node1,node2", "node1"), ("a[1-2]-ib", "a1-ib"), ("single", "single")],
)
def test_first_host(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


def test_pet_variables_win_over_slurm() -> None:
    env = {
        "PET_NNODES": "2",
        "SLURM_NNODES": "5",
        "PET_MASTER_ADDR": "a",
        "SLURM_JOB_NODELIST": "b[1-5]",
        "PET_NODE_RANK": "1",
    }
    plan = resolve_plan(nproc="1", env=env)
    assert (plan.nnodes, plan.master_addr) == ("2", "a")


def test_elastic_c10d_command() -> None:
    plan = resolve_plan(
        nnodes="1:4",
        nproc="2",
        master="[fe80::1]:29400",
        rdzv="c10d",
        rdzv_id="job7",
        rdzv_conf=["join_timeout=60"],
        max_restarts=3,
        env={},
    )
    argv = torchrun_argv(plan, "job.yaml", [])
    assert {
        "--nnodes=1:4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=[fe80::1]:29400",
        "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3,last_call_timeout=10",
        "--max-restarts=3",
    } <= set(argv)
    assert not any(arg.startswith("--node-rank") for arg in argv)


def test_c10d_names_the_store_host_from_the_node_rank_unless_told() -> None:
    host = resolve_plan(nnodes="2", node_rank=0, master="h:1", nproc="1", rdzv="c10d", rdzv_id="x", env={})
    assert [item for item in host.rdzv_conf if item.startswith("is_host")] == ["is_host=1"]
    told = resolve_plan(
        nnodes="2", node_rank=0, master="h:1", nproc="1", rdzv="c10d", rdzv_id="x", rdzv_conf=["is_host=0"], env={}
    )
    assert [item for item in told.rdzv_conf if item.startswith("is_host")] == ["is_host=0"]


def test_c10d_drops_a_silent_node_after_6_seconds_unless_told() -> None:
    """torch's defaults keep every survivor waiting 15 s for a lost host, then 30 s more for other nodes."""
    plan = resolve_plan(nnodes="1:2", master="h:1", nproc="1", rdzv="c10d", rdzv_id="x", env={})
    conf = dict(item.split("=") for item in plan.rdzv_conf)
    assert int(conf["keep_alive_interval"]) * int(conf["keep_alive_max_attempt"]) == 6
    assert conf["last_call_timeout"] == "10"
    assert f"--rdzv-conf={','.join(plan.rdzv_conf)}" in torchrun_argv(plan, "job.yaml", [])
    told = resolve_plan(nnodes="1:2", master="h:1", nproc="1", rdzv="c10d", rdzv_id="x",
                        rdzv_conf=["keep_alive_interval=10"], env={})
    conf = dict(item.split("=") for item in told.rdzv_conf)
    assert (conf["keep_alive_interval"], conf["keep_alive_max_attempt"]) == ("10", "3")
    assert [item.split("=")[0] for item in told.rdzv_conf].count("keep_alive_interval") == 1
    static = resolve_plan(nnodes="2", node_rank=0, master="h:1", nproc="1", env={})
    assert static.rdzv_conf == ()


def test_c10d_advertises_the_address_of_the_jobs_nic() -> None:
    plan = resolve_plan(nnodes="2", master="h:1", nproc="1", rdzv="c10d", rdzv_id="x", nic="lo", env={})
    assert plan.local_addr == "127.0.0.1"
    assert "--local-addr=127.0.0.1" in torchrun_argv(plan, "job.yaml", [])
    assert (
        resolve_plan(
            nnodes="2", master="h:1", nproc="1", rdzv="c10d", rdzv_id="x", nic="no-such-nic0", env={}
        ).local_addr
        is None
    )


def test_rendezvous_id_defaults_to_what_the_caller_shares() -> None:
    plan = resolve_plan(nnodes="2", master="h:1", nproc="1", rdzv="c10d", default_rdzv_id="tiny", env={})
    assert plan.rdzv_id == "tiny"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nnodes": "2", "node_rank": 0}, "--master HOST:PORT"),
        ({"nnodes": "2", "master": "h:1"}, "--node-rank"),
        ({"nnodes": "2", "node_rank": 2, "master": "h:1"}, "not below --nnodes 2"),
        ({"nnodes": "1:4", "master": "h:1"}, "needs --rdzv c10d"),
        ({"nnodes": "two"}, "--nnodes 'two'"),
        ({"nnodes": "2", "master": "h:1", "rdzv": "c10d"}, "--rdzv-id"),
        ({"nproc": "0"}, "--nproc '0'"),
        ({"master": "a:b:c", "nnodes": "2", "node_rank": 0}, "--master 'a:b:c'"),
        ({"rdzv": "etcd"}, "--rdzv 'etcd'"),
    ],
)
def test_user_errors_name_the_option_and_a_fix(kwargs: dict, needle: str) -> None:
    kwargs.setdefault("nproc", "1")
    with pytest.raises(ConfigError) as err:
        resolve_plan(env={}, **kwargs)
    assert needle in err.value.render() and "Fix:" in err.value.render()


def test_bad_node_rank_from_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="SLURM_NODEID"):
        resolve_plan(nproc="1", env={"SLURM_NODEID": "x"})


def test_split_host_port() -> None:
    assert split_host_port("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert split_host_port("[::1]:5") == ("::1", 5)
    assert split_host_port("head") == ("head", None)


def test_network_preset_fills_what_the_user_left_unset() -> None:
    added, lines = network_settings(DistConfig(network="socket", nic="eth7"), {"NCCL_SOCKET_IFNAME": "ib0"})
    assert added["NCCL_IB_DISABLE"] == "1" and added["GLOO_SOCKET_IFNAME"] == "eth7"
    assert "NCCL_SOCKET_IFNAME" not in added  # the user's own value wins
    assert any("NCCL_SOCKET_IFNAME=ib0  (yours, kept)" in line for line in lines)
    assert any("NCCL_NET=Socket  (preset)" in line for line in lines)


# ---------------------------------------------------------------- running (real processes)

_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    def stop(signum, frame):
        with open(os.environ["TRAINYARD_EXIT_FILE"] + ".rank0", "w") as f:
            f.write("75\\nstopped by SIGUSR1 after step 3; checkpoint step-00000003 is committed")
        sys.exit(1)  # what torchrun reports whatever its worker said
    signal.signal(signal.SIGUSR1, stop)
    print("ready", flush=True)
    time.sleep(30)
    """
)


def _launcher(tmp_path: Path, preempt_code: int) -> subprocess.Popen:
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    driver = (
        "import sys; from trainyard.launch.torchrun import run_torchrun; "
        f"sys.exit(run_torchrun([sys.executable, {str(worker)!r}], dict(__import__('os').environ), {preempt_code})[0])"
    )
    return subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("preempt_code", [75, 203])
def test_preemption_signal_is_forwarded_and_75_survives_torchrun(tmp_path: Path, preempt_code: int) -> None:
    launcher = _launcher(tmp_path, preempt_code)
    assert launcher.stdout is not None and launcher.stdout.readline().strip() == "ready"
    launcher.send_signal(signal.SIGUSR1)
    assert launcher.wait(timeout=20) == preempt_code


_AGENT_WORKER = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(75))  # saved, reported, stopped
    print("ready", flush=True)
    time.sleep(int(sys.argv[1]))
    print("trainyard: error (a stand-in)", file=sys.stderr, flush=True)
    sys.exit(int(sys.argv[2]))
    """
)


def _agent(tmp_path: Path, sleep_s: int, exit_code: int = 3) -> subprocess.Popen:
    """The agent command `trainyard launch` runs, with a stand-in worker instead of `trainyard.cli`."""
    worker = tmp_path / "worker.py"
    worker.write_text(_AGENT_WORKER)
    argv = torchrun_argv(resolve_plan(nproc="1", env={}), "job.yaml", [])
    argv = argv[: argv.index("-m", 3)] + [str(worker), str(sleep_s), str(exit_code)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_agent_ends_a_stop_signal_in_an_exit_code_not_a_traceback(tmp_path: Path) -> None:
    """Slurm signals the agent too; torchrun itself prints a SignalException traceback."""
    agent = _agent(tmp_path, 120)
    assert agent.stdout is not None and agent.stdout.readline().strip() == "ready"
    agent.send_signal(signal.SIGUSR1)
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 128 + signal.SIGUSR1, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr


def test_agent_keeps_torchruns_report_of_a_real_failure(tmp_path: Path) -> None:
    agent = _agent(tmp_path, 0)
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 1 and "ChildFailedError" in stderr and "exitcode  : 3" in stderr, stderr


def test_agent_ends_workers_user_error_in_exit_2_without_its_report(tmp_path: Path) -> None:
    """Every worker printed the bad input and its fix; torchrun's ChildFailedError traceback would bury it."""
    agent = _agent(tmp_path, 0, exit_code=2)
    _, stderr = agent.communicate(timeout=120)
    assert agent.returncode == 2, stderr
    assert "trainyard: error (a stand-in)" in stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr


def test_the_first_report_is_the_root_cause(tmp_path: Path) -> None:
    """Rank 1 lost the remote peer; rank 0 failed later, on rank 1's exit."""
    (tmp_path / "exit.rank1").write_text("1\nrank 1 lost its peers: Connection reset by peer [10.123.0.2]:4000")
    (tmp_path / "exit.rank0").write_text("1\nrank 0 lost its peers: Connection closed by peer [10.123.0.1]:4001")
    os.utime(tmp_path / "exit.rank1", ns=(1_000_000_000, 1_000_000_000))
    code, message = first_reported_failure(str(tmp_path / "exit"))
    assert code == 1 and "10.123.0.2" in message
    assert first_reported_failure(str(tmp_path / "none")) is None


def test_plain_failure_keeps_its_exit_code() -> None:
    assert run_torchrun([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ)) == (3, None)
    assert run_torchrun([sys.executable, "-c", "pass"], dict(os.environ)) == (0, None)


def test_launch_config_error_exits_2_before_starting_anything(tmp_path: Path) -> None:
    result = run_cli("launch", TINY, "train.lr=fast", "--nnodes", "2", "--node-rank", "0", "--master", "127.0.0.1:1")
    assert result.returncode == 2 and "train.lr" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("launch", TINY, "--nnodes", "2", "--node-rank", "0")
    assert result.returncode == 2 and "--master" in result.stderr
