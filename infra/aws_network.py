"""An AWS target's network: its subnet in the zone tried, and a security group per host that admits
the agent and service ports only from the addresses :func:`gpumigrate.infra.network.port_rules` names.

The group is tagged like the instance (migration id, host) and named after the host, so a retried
provision finds it; :func:`delete_group` waits out EC2's DependencyViolation while the instance
that used it is still shutting down.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpumigrate.errors import InvalidInputError, ProviderError
from gpumigrate.infra.network import PortRule
from gpumigrate.plan import TargetNetwork


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def subnet_for_zone(ec2: Any, network: TargetNetwork, zone: str | None) -> tuple[str, str, str]:
    """(subnet id, VPC id, zone) to launch in: the plan's subnet in ``zone``, else the default subnet there."""
    if network.subnets:
        subnets = ec2.describe_subnets(SubnetIds=list(network.subnets))["Subnets"]
        if network.vpc:
            subnets = [s for s in subnets if s["VpcId"] == network.vpc]
        where = ", ".join(f"{s['SubnetId']} ({s['AvailabilityZone']})" for s in subnets) or "none"
    else:
        filters = [{"Name": "default-for-az", "Values": ["true"]}]
        if network.vpc:
            filters = [{"Name": "vpc-id", "Values": [network.vpc]}]
        else:
            vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise InvalidInputError(
                    "this AWS region has no default VPC: set target.network.vpc and target.network.subnets"
                )
            filters.append({"Name": "vpc-id", "Values": [vpcs[0]["VpcId"]]})
        subnets = ec2.describe_subnets(Filters=filters)["Subnets"]
        where = "the VPC's subnets"
    in_zone = sorted((s for s in subnets if zone is None or s["AvailabilityZone"] == zone), key=lambda s: s["SubnetId"])
    if not in_zone:
        raise InvalidInputError(
            f"no subnet in zone {zone} (of {where}): add one in that zone to target.network.subnets, or drop the zone"
        )
    chosen = in_zone[0]
    return chosen["SubnetId"], chosen["VpcId"], chosen["AvailabilityZone"]


def group_name(host_name: str) -> str:
    return f"gpumigrate-{host_name}"


def find_groups(ec2: Any, tags: Mapping[str, str]) -> list[dict[str, Any]]:
    filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in tags.items()]
    return list(ec2.describe_security_groups(Filters=filters)["SecurityGroups"])


def ensure_group(ec2: Any, *, vpc_id: str, host_name: str, tags: Mapping[str, str]) -> str:
    """The host's security group in ``vpc_id``, created (no ingress yet) when absent."""
    name = group_name(host_name)
    found = ec2.describe_security_groups(
        Filters=[{"Name": "group-name", "Values": [name]}, {"Name": "vpc-id", "Values": [vpc_id]}]
    )["SecurityGroups"]
    if found:
        return str(found[0]["GroupId"])
    created = ec2.create_security_group(
        GroupName=name,
        Description=f"gpumigrate target {host_name}: agent and service ports only",
        VpcId=vpc_id,
        TagSpecifications=[
            {"ResourceType": "security-group", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
        ],
    )
    return str(created["GroupId"])


def _permission(rule: PortRule) -> dict[str, Any]:
    perm: dict[str, Any] = {"IpProtocol": "tcp", "FromPort": rule.port, "ToPort": rule.last}
    if rule.v4():
        perm["IpRanges"] = [{"CidrIp": c, "Description": f"gpumigrate {rule.name}"} for c in rule.v4()]
    if rule.v6():
        perm["Ipv6Ranges"] = [{"CidrIpv6": c, "Description": f"gpumigrate {rule.name}"} for c in rule.v6()]
    return perm


def admit(ec2: Any, group_id: str, rules: list[PortRule]) -> None:
    """Add the ingress rules (an identical rule already there is fine)."""
    try:
        ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=[_permission(r) for r in rules])
    except ClientError as exc:
        if _code(exc) != "InvalidPermission.Duplicate":
            raise


def delete_group(ec2: Any, group_id: str, *, timeout_s: float = 300, poll_s: float = 5) -> None:
    """Delete the group; retry while a terminating instance still holds it; gone already is fine."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ec2.delete_security_group(GroupId=group_id)
            return
        except ClientError as exc:
            code = _code(exc)
            if code in ("InvalidGroup.NotFound", "InvalidGroupId.NotFound"):
                return
            if code != "DependencyViolation" or time.monotonic() >= deadline:
                raise ProviderError(f"AWS security group {group_id} could not be deleted: {code}") from None
        except BotoCoreError as exc:
            raise ProviderError(f"AWS security group {group_id} could not be deleted: {exc}") from None
        time.sleep(poll_s)
