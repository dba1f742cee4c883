"""The network preset reaches the environment inside `dist.init`, before any process group
exists; a NIC this host lacks is a user error naming it, in our words rather than Gloo's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import get_args

import psutil
import pytest
import torch.distributed as tdist

from tests.conftest import REPO
from trainyard import dist, network
from trainyard.config import DistConfig
from trainyard.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def environ() -> Iterator[dict[str, str]]:
    """os.environ without network or torchrun variables; restored afterwards."""
    saved = dict(os.environ)
    for name in [*network.network_env("wan", "x"), *network.network_env("infiniband", None), *TORCHRUN_VARS]:
        os.environ.pop(name, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def test_init_sets_the_preset_and_keeps_the_users_own(environ: dict[str, str]) -> None:
    environ["NCCL_SOCKET_IFNAME"] = "ib0"
    info = dist.init(DistConfig(network="wan", nic="lo"))
    for name, value in network.network_env("wan", None).items():
        assert environ[name] == value, name
    assert environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert environ["NCCL_SOCKET_IFNAME"] == "ib0"  # the user's own value wins over dist.nic
    assert info.network["NCCL_SOCKET_IFNAME"] == "ib0" and info.network["NCCL_NET"] == "Socket"


def test_a_missing_nic_fails_before_the_process_group(environ: dict[str, str]) -> None:
    environ.update(RANK="0", WORLD_SIZE="2")
    with pytest.raises(ConfigError) as caught:
        dist.init(DistConfig(nic="nosuch0"), nic_where="job.yaml:31")
    assert not tdist.is_initialized()
    assert environ["GLOO_SOCKET_IFNAME"] == "nosuch0"  # in the environment before the group would be made
    err = caught.value
    assert err.exit_code == 2 and err.where == "job.yaml:31"
    assert "dist.nic" in err.what and "'nosuch0' does not exist" in err.what
    assert socket.gethostname() in err.what and "lo (127.0.0.1)" in err.what


def test_an_existing_nic_passes() -> None:
    network.check_nic("lo")


def test_a_nic_without_an_address_is_named_as_such() -> None:
    bare = [name for name, ips in network.interface_addresses().items() if not ips]
    if not bare:
        pytest.skip(f"every interface here has an IP address: {sorted(psutil.net_if_addrs())}")
    with pytest.raises(ConfigError, match=f"'{bare[0]}' has no IP address"):
        network.check_nic(bare[0])


GLOO_MISSING_NIC = """
import torch.distributed as dist
try:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
except RuntimeError as err:
    print(err)
"""


def test_gloos_own_error_for_a_missing_interface_becomes_a_user_error(environ: dict[str, str]) -> None:
    """The pattern is checked against what this torch's Gloo really says."""
    env = {**environ, "GLOO_SOCKET_IFNAME": "nosuch1"}
    result = subprocess.run(
        [sys.executable, "-c", GLOO_MISSING_NIC], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    assert "nosuch1" in result.stdout, result.stdout + result.stderr[-3000:]
    environ["GLOO_SOCKET_IFNAME"] = "nosuch1"
    err = network.interface_error(result.stdout)
    assert err is not None and err.exit_code == 2
    assert "GLOO_SOCKET_IFNAME=nosuch1" in err.what and "lo (127.0.0.1)" in err.what
    assert network.interface_error("Connection reset by peer") is None


PRESETS = get_args(DistConfig.model_fields["network"].annotation)


def test_socket_preset_tunes_tcp_as_nccl_documents_for_100g() -> None:
    """Seed 000 ran this preset over 100G TCP with NCCL's one thread and one socket per connection."""
    preset = network.network_env("socket", None)
    assert (preset["NCCL_SOCKET_NTHREADS"], preset["NCCL_NSOCKS_PERTHREAD"]) == ("4", "4")
    assert (preset["NCCL_IB_DISABLE"], preset["NCCL_NET"]) == ("1", "Socket")


@pytest.mark.parametrize("name", PRESETS)
def test_no_preset_sets_async_error_handling(name: str) -> None:
    """1 aborts communicators before tearing down, which can block on a partitioned network: torch's default (3)
    tears down without the abort."""
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in network.network_env(name, "eth0")


@pytest.mark.parametrize("name", PRESETS)
def test_socket_threads_stay_within_what_nccl_accepts(name: str) -> None:
    preset = network.network_env(name, None)
    threads, sockets = int(preset.get("NCCL_SOCKET_NTHREADS", 1)), int(preset.get("NCCL_NSOCKS_PERTHREAD", 1))
    assert 1 <= threads <= 16 and threads * sockets <= 64, preset


@pytest.mark.parametrize("name", PRESETS)
def test_no_preset_sets_a_variable_nothing_reads_or_overrides_nccls_topology_choice(name: str) -> None:
    preset = network.network_env(name, None)
    assert "GLOO_USE_IPV6" not in preset and "NCCL_NET_GDR_LEVEL" not in preset, preset
