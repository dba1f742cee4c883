"""The network between nodes: the presets `dist.network` sets before any process group exists, the interfaces of
this host, and the checks that name a bad `dist.nic` or *_SOCKET_IFNAME in one sentence. Shared by dist,
doctor and launch; imports only config and errors.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

import psutil

from trainyard.config import DistConfig
from trainyard.errors import ConfigError

_PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    # Plain TCP: seed 002's stable path when InfiniBand probing misbehaves; seed 000 ran it over 100G TCP.
    "socket": {
        "NCCL_IB_DISABLE": "1",  # no IB/RoCE transport: NCCL falls back to IP sockets
        "NCCL_NET": "Socket",  # NCCL's own TCP network by name, so no plugin or other network is picked
        # NCCL's docs: "for generic 100G networks" 4 helper threads per connection and 4 sockets per thread
        # (their defaults are 1 and 1 off AWS and GCP); threads x sockets must not exceed 64.
        "NCCL_SOCKET_NTHREADS": "4",
        "NCCL_NSOCKS_PERTHREAD": "4",
    },
    # IB on, also over an /etc/nccl.conf that disables it (the environment wins). NCCL_NET_GDR_LEVEL stays unset:
    # NCCL then picks GPU Direct RDMA's reach from the topology (its docs); a fixed PHB forced it through the CPU.
    "infiniband": {"NCCL_IB_DISABLE": "0"},
    # Long fat pipes between sites: more sockets and threads, bigger buffers, no IB. Tuning helps a WAN
    # only so far: a job whose gradients cross it every step should run dist.strategy: diloco, which
    # crosses it once per diloco.sync_every steps (benchmarks/diloco/diloco_wan.py measures the difference).
    # TORCH_NCCL_ASYNC_ERROR_HANDLING stays at torch's default, 3: on an error the process is torn down without
    # ncclCommAbort, which (under 1) can block on a partitioned network and leave the job hanging.
    "wan": {
        "NCCL_IB_DISABLE": "1",  # IB does not cross sites: IP sockets
        "NCCL_NET": "Socket",  # NCCL's own TCP network by name, so no plugin or other network is picked
        # NCCL's docs: more sockets per thread help "where per-socket speed is limited", as a long round trip
        # limits each TCP stream; threads may be 1 to 16; 8 x 4 = 32 streams, within the 64 allowed.
        "NCCL_SOCKET_NTHREADS": "8",
        "NCCL_NSOCKS_PERTHREAD": "4",
        # 8 MiB, twice NCCL's default, a power of 2 as its docs advise: a channel has at most one buffer in flight,
        # so a long round trip caps it near NCCL_BUFFSIZE / RTT (larger is faster up to a point: NVIDIA/nccl#387).
        "NCCL_BUFFSIZE": "8388608",
    },
}
"""Only variables NCCL reads, each for the reason beside it; no GLOO_USE_IPV6, which neither Gloo nor torch reads."""


def network_env(network: str, nic: str | None) -> dict[str, str]:
    """The variables a preset wants, before the user's own environment is applied."""
    wanted = dict(_PRESETS[network])
    if nic:
        wanted["NCCL_SOCKET_IFNAME"] = nic
        wanted["GLOO_SOCKET_IFNAME"] = nic
    return wanted


def apply_network_preset(cfg: DistConfig, env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the preset's variables where the user has not; return the effective values."""
    target = os.environ if env is None else env
    effective = {}
    for name, value in network_env(cfg.network, cfg.nic).items():
        target.setdefault(name, value)
        effective[name] = target[name]
    return effective


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# What each library says when its interface variable names nothing usable on this host: Gloo
# (torch 2.13); NCCL's bootstrap (2.21), and 2.27's garbled address when it found no interface.
_IFNAME_FAILURES = {
    "GLOO_SOCKET_IFNAME": re.compile(r"Unable to find address for: \S+"),
    "NCCL_SOCKET_IFNAME": re.compile(r"no socket interface found|NCCL_SOCKET_IFNAME interface|neither AF_INET"),
}


def interface_addresses(usable: bool = False) -> dict[str, list[str]]:
    """Every interface of this host with its IP addresses (none: Gloo and NCCL cannot use it); `usable`: only
    interfaces that are up, with their routable addresses (IPv6 link-local left out)."""
    ip_families = (socket.AF_INET, socket.AF_INET6)
    found = {
        name: [a.address.split("%")[0] for a in addrs if a.family in ip_families]
        for name, addrs in psutil.net_if_addrs().items()
    }
    if not usable:
        return found
    stats = psutil.net_if_stats()
    routable = {name: [ip for ip in ips if not ipaddress.ip_address(ip).is_link_local] for name, ips in found.items()}
    return {name: ips for name, ips in routable.items() if ips and stats.get(name) and stats[name].isup}


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of a network interface, or None."""
    return next((ip for ip in interface_addresses().get(name, []) if ipaddress.ip_address(ip).version == 4), None)


def _usable_listing(found: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({ips[0]})" for name, ips in sorted(found.items()) if ips) or "none"


def check_nic(nic: str, where: str | None = None) -> None:
    """`dist.nic` names an interface of this host with an IP address; else say which ones do.

    Checked before the process group, so the job fails here in one sentence rather than
    in Gloo's or NCCL's own words, which name neither the field nor the interfaces there are."""
    found = interface_addresses()
    if found.get(nic):
        return
    problem = "has no IP address" if nic in found else "does not exist"
    raise ConfigError(
        f"dist.nic: network interface '{nic}' {problem} on host {socket.gethostname()}; "
        f"interfaces with an address there: {_usable_listing(found)}",
        where=where,
        fix="set dist.nic to the interface on the network the other nodes reach, or remove it to let NCCL "
        "and Gloo pick one",
    )


def interface_error(message: str) -> ConfigError | None:
    """A process-group failure caused by GLOO_/NCCL_SOCKET_IFNAME, as a user error naming the variable."""
    for name, pattern in _IFNAME_FAILURES.items():
        value = os.environ.get(name)
        if value and pattern.search(message):
            return ConfigError(
                f"{name}={value} names no network interface with an address on host {socket.gethostname()}; "
                f"interfaces with an address there: {_usable_listing(interface_addresses())}",
                where="the environment",
                fix=f"export {name} naming one of those interfaces, or unset it and set dist.nic in the config",
            )
    return None
