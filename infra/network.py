"""Ports and who may reach them: the rules a cloud target's security group / firewall carries.

The workload on a target listens on at most two ports (``target.network``): the agent port (one per rank
from it, for a workload of several ranks), which only the orchestrator may reach (it drives the snapshot agent), and — when it serves HTTP — the service
port, which the orchestrator (health, parity) and the front door (Envoy, live traffic) reach. Nothing
else is opened. Provider
modules turn :func:`port_rules` into their cloud's objects.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from gpumigrate.errors import InvalidInputError
from gpumigrate.infra.launch import serves_http
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.plan import TargetNetwork

# A documentation address (RFC 5737): connecting a UDP socket to it sends nothing.
_PROBE_V4 = "192.0.2.1"


@dataclass(frozen=True)
class PortRule:
    """Admit TCP ``port`` from ``cidrs`` only."""

    name: str  # "agent" | "service"
    port: int
    cidrs: tuple[str, ...]
    count: int = 1  # ports port .. port + count - 1: the agents of a workload of several ranks (rank r's at + r)

    @property
    def last(self) -> int:
        return self.port + self.count - 1

    def v4(self) -> list[str]:
        return [c for c in self.cidrs if ipaddress.ip_network(c).version == 4]

    def v6(self) -> list[str]:
        return [c for c in self.cidrs if ipaddress.ip_network(c).version == 6]


def ports(network: TargetNetwork, launch: WorkloadLaunch) -> dict[str, int]:
    """The ports a target's workload listens on, by name (the Host record's ``ports``): the agent's, and
    the service's when the workload serves HTTP. Only these are opened."""
    out = {"service": int(network.service_port)} if serves_http(launch) else {}
    return {**out, "agent": int(network.agent_port)}


def as_cidr(text: str) -> str:
    """``10.0.1.15`` → ``10.0.1.15/32``; a block stays itself (host bits cleared)."""
    return str(ipaddress.ip_network(text, strict=False))


def source_address_towards(address: str) -> str:
    """The address this machine's packets to ``address`` leave from (no packet is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def own_address() -> str:
    """This machine's primary address: the source address of its default route."""
    return source_address_towards(_PROBE_V4)


def needs_instance_address(network: TargetNetwork) -> bool:
    """True when the rules can only be written once the instance's address is known (auto orchestrator)."""
    return not network.orchestrator


def port_rules(
    network: TargetNetwork, instance_address: str | None = None, *, service: bool = True, agents: int = 1
) -> list[PortRule]:
    """The ingress rules: the agent port (``agents`` of them from it: one per rank), and the service port unless
    ``service`` is false (a workload that serves no HTTP). Without ``network.orchestrator``, the orchestrator is the address this process
    reaches ``instance_address`` from (private addressing: no NAT between the two)."""
    orchestrator = [as_cidr(c) for c in network.orchestrator]
    if not orchestrator:
        if network.public_ip:
            raise InvalidInputError(
                "target.network.orchestrator is required with public_ip: the orchestrator's address behind NAT "
                "is not knowable from here"
            )
        if instance_address is None:
            raise InvalidInputError("the orchestrator's address is derived from the instance's: none is known yet")
        orchestrator = [as_cidr(source_address_towards(instance_address))]
    frontdoor = [as_cidr(c) for c in network.frontdoor] or orchestrator
    rules = [PortRule("agent", int(network.agent_port), tuple(orchestrator), count=agents)]
    if service:
        rules.append(PortRule("service", int(network.service_port), tuple(dict.fromkeys([*orchestrator, *frontdoor]))))
    return rules
