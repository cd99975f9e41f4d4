"""A GCP target's network: firewall rules of its own, bound to the instance by a network tag, that admit
the agent and service ports only from the addresses :func:`gpumigrate.infra.network.port_rules` names.

GCE firewall rules belong to the VPC network, not to the instance: each rule targets the host's
network tag, is named after the host (so a retried provision finds it), and is deleted with the host.
A rule holds IPv4 or IPv6 sources, not both, so a rule with both families becomes two.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from google.cloud import compute_v1

from gpumigrate.infra.network import PortRule


def host_tag(instance_name: str) -> str:
    """The network tag that binds the host's firewall rules to it (the instance name is a valid tag)."""
    return instance_name


def rule_name(instance_name: str, rule: str, family: int) -> str:
    """A firewall rule name: [a-z]([-a-z0-9]{0,61}[a-z0-9])?, unique per host, rule and address family."""
    base = f"{instance_name}-{rule}" + ("-v6" if family == 6 else "")
    if len(base) > 63:
        base = base[:50] + "-" + hashlib.sha256(base.encode()).hexdigest()[:12]
    return re.sub(r"-+$", "", base)


def network_url(project: str, network: str) -> str:
    """``default`` → ``projects/P/global/networks/default``; a path or URL stays as given."""
    return network if "/" in network else f"projects/{project}/global/networks/{network}"


def firewalls(project: str, network: str, instance_name: str, rules: list[PortRule]) -> list[compute_v1.Firewall]:
    """The firewall rules for one host: one per port rule and address family."""
    out = []
    for rule in rules:
        for family, sources in ((4, rule.v4()), (6, rule.v6())):
            if not sources:
                continue
            out.append(
                compute_v1.Firewall(
                    name=rule_name(instance_name, rule.name, family),
                    description=f"gpumigrate {rule.name} port of {instance_name}",
                    network=network_url(project, network),
                    direction="INGRESS",
                    priority=1000,
                    source_ranges=sources,
                    target_tags=[host_tag(instance_name)],
                    allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=[_port_range(rule)])],
                )
            )
    return out


def _port_range(rule: PortRule) -> str:
    """``"7070"``, or ``"7070-7071"`` for the agents of two ranks (GCP's form of a range)."""
    return str(rule.port) if rule.count == 1 else f"{rule.port}-{rule.last}"


def names_for(instance_name: str) -> list[str]:
    """Every rule name a host may have (for deletion: a missing one is fine)."""
    return [rule_name(instance_name, r, f) for r in ("agent", "service") for f in (4, 6)]


def secret_locations(secret: dict[str, Any]) -> list[str] | None:
    """Where a Secret Manager secret keeps its data: the user-managed replicas' locations, or None when
    Google chooses (automatic replication: anywhere)."""
    replicas = ((secret.get("replication") or {}).get("userManaged") or {}).get("replicas") or []
    locations = [r["location"] for r in replicas if r.get("location")]
    return locations or None
