"""Network checks of one machine: the NIC that NCCL/Gloo will use and the master port."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import psutil

from trainyard.doctor.checks import Check, fail, ok, warn
from trainyard.errors import OptionError
from trainyard.network import interface_addresses


def parse_master(master: str) -> tuple[str, int]:
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptionError(
            f"--master {master!r} is not HOST:PORT",
            fix="pass the address of node 0 and a free port, for example --master 10.0.0.1:29500",
        )
    return host.strip("[]"), int(port)


def matching_interfaces(spec: str, names: list[str], prefix_match: bool) -> list[str]:
    """NCCL_SOCKET_IFNAME rules: prefixes, `=` for exact names, `^` to exclude; Gloo: exact names."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=") or not prefix_match
    parts = [part for part in spec.lstrip("=").split(",") if part]

    def named(name: str) -> bool:
        return any(name == part if exact else name.startswith(part) for part in parts)

    return [name for name in names if named(name) != exclude]


def nic_settings(nic: str | None) -> list[tuple[str, str, bool]]:
    """(where it came from, value, NCCL prefix rules?) for every interface setting in force."""
    if nic:
        return [("--nic / dist.nic", nic, False)]
    return [
        (name, os.environ[name], name.startswith("NCCL"))
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
        if os.environ.get(name)
    ]


def check_nic(nic: str | None, multi_node: bool) -> list[Check]:
    """The named interface exists, is up and has an address; else list the ones that do."""
    settings = nic_settings(nic)
    if not settings:
        detail = "none named; NCCL and Gloo pick an interface themselves"
        if multi_node:
            return [
                warn(
                    "nic",
                    detail,
                    "name the cluster network's interface: --nic NAME or dist.nic (they may pick docker0 or lo)",
                )
            ]
        return [ok("nic", detail)]
    usable = interface_addresses(usable=True)
    listing = ", ".join(f"{name} ({ips[0]})" for name, ips in sorted(usable.items())) or "none"
    all_names = list(psutil.net_if_addrs())
    checks = []
    for origin, value, prefix_match in settings:
        name = f"nic {value} ({origin})"
        named = matching_interfaces(value, all_names, prefix_match)
        good = [n for n in named if n in usable]
        if not named:
            checks.append(
                fail(
                    name,
                    f"no interface matches; interfaces with an address: {listing}",
                    "pass --nic NAME (or set dist.nic) to the interface on the network the other nodes reach",
                )
            )
        elif not good:
            checks.append(
                fail(
                    name,
                    f"{', '.join(named)} is down or has no IP address",
                    f"bring it up with an address, or use one of: {listing}",
                )
            )
        elif multi_node and all(n == "lo" for n in good):
            checks.append(
                fail(name, "loopback reaches only this machine", f"use the cluster network's interface: {listing}")
            )
        else:
            checks.append(ok(name, "; ".join(f"{n} {', '.join(usable[n])}" for n in good)))
    return checks


def check_master(master: str | None, node_rank: int, nnodes: int | None) -> list[Check]:
    """Node 0 must be able to listen on the port; other nodes must reach it."""
    if not master:
        return []
    host, port = parse_master(master)
    if node_rank == 0:
        return [check_port_free(host, port, multi_node=(nnodes or 1) > 1)]
    if nnodes is not None:
        return []  # the probe's rendezvous tests reachability for real, once node 0 is up
    return [check_reachable(host, port)]


def check_port_free(host: str, port: int, multi_node: bool) -> Check:
    name = f"master port {port}"
    try:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6).close()
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            return fail(
                name, f"cannot listen on port {port}: {err.strerror}", "choose another port (>1024) in --master"
            )
        return fail(
            name,
            f"port {port} is in use{port_owner(port)}",
            f"stop the stale job holding it (ss -ltnp 'sport = :{port}'), "
            "or choose another port in --master on every node",
        )
    if multi_node and is_loopback(host):
        return fail(
            name,
            f"{host} is a loopback address: other nodes cannot reach it",
            "pass node 0's address on the cluster network in --master",
        )
    return ok(name, f"free on this node (node 0 hosts the rendezvous at {host}:{port})")


def port_owner(port: int) -> str:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def check_reachable(host: str, port: int) -> Check:
    name = f"master {host}:{port}"
    try:
        socket.create_connection((host, port), timeout=3).close()
    except socket.gaierror:
        return fail(name, f"cannot resolve {host}", "use node 0's IP address, or fix DNS / /etc/hosts on this node")
    except ConnectionRefusedError:
        return fail(
            name, "connection refused: nothing listens there", "start node 0 first, and check the port in --master"
        )
    except OSError as err:
        return fail(
            name,
            f"no connection in 3 s ({err.strerror or err})",
            "check the address, the route and the firewall between the nodes",
        )
    return ok(name, "reachable from this node")
