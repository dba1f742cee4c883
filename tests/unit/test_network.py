"""The network preset reaches the environment inside `dist.init`, before any process group
exists; a NIC this host lacks is a user error naming it, in our words rather than Gloo's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

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
