"""``gpumigrate hosts``: local hosts (supervised process groups, optionally in network namespaces).

    gpumigrate hosts up [--name local-a --name local-b] [--netns] [--rate 1gbit] [--delay 10ms] [--json]
    gpumigrate hosts list [--json]
    gpumigrate hosts down (--all | NAME ...)     also removes their files (image store, logs) that no migration needs

Hosts brought up here are detached: they outlive this command until ``hosts down``. A migration
whose target names one of them adopts it. ``list`` and ``down`` also clean up after hosts whose
supervisor died (processes, namespaces, registry entries).
"""

from __future__ import annotations

from typing import Any

import typer

from gpumigrate.cli.output import console, emit_json
from gpumigrate.errors import InvalidInputError

app = typer.Typer(help="Local hosts: processes on this machine standing in for cloud hosts.", no_args_is_help=True)


def _provider(**options: Any) -> Any:
    from gpumigrate.infra.local import LocalProvider  # lazy: the CLI starts fast

    return LocalProvider(**options)


def _host_json(host: Any) -> dict[str, Any]:
    return {
        "name": host.name,
        "region": host.region,
        "address": host.address,
        "ports": host.ports,
        "workdir": host.workdir,
        "supervisor_pid": host.meta.get("supervisor_pid"),
        "netns": host.meta.get("netns"),
        "migration_id": host.meta.get("migration_id"),
        "attached": host.meta.get("attached"),
    }


def _region_for(name: str) -> str:
    from gpumigrate.infra import residency

    return name if residency.lookup("local", name) is not None else "local"


@app.command("up")
def up(
    name: list[str] = typer.Option(None, "--name", "-n", help="host name (repeatable); default local-a and local-b"),
    netns: bool = typer.Option(False, "--netns", help="each host in its own network namespace (root only)"),
    rate: str = typer.Option(None, "--rate", help="shape each host's link, e.g. 1gbit (needs --netns)"),
    delay: str = typer.Option(None, "--delay", help="add latency, e.g. 10ms (needs --netns and netem)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Start local hosts (idempotent: a host already up is left as it is)."""
    from gpumigrate.interfaces import HostSpec

    names = name or ["local-a", "local-b"]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"host names repeat: {names}")
    provider = _provider(netns=netns, rate=rate, delay=delay, attached=False)
    hosts = []
    for n in names:
        host = provider.provision(HostSpec(name=n, provider="local", region=_region_for(n)), migration_id=None)
        hosts.append(host)
        console.print(
            f"up  {host.name:<12} {host.address:<12} service={host.ports['service']} agent={host.ports['agent']}"
        )
    if as_json:
        emit_json({"hosts": [_host_json(h) for h in hosts]})


@app.command("list")
def list_hosts(as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout")) -> None:
    """Show the local hosts that are up."""
    hosts = _provider().list_hosts()
    if as_json:
        emit_json({"hosts": [_host_json(h) for h in hosts]})
        return
    if not hosts:
        console.print("no local hosts are up")
    for h in hosts:
        ports = " ".join(f"{k}={v}" for k, v in h.ports.items())
        console.print(
            f"{h.name:<12} {h.address:<12} pid={h.meta.get('supervisor_pid')} netns={h.meta.get('netns') or '-'} {ports}"
        )


@app.command("down")
def down(
    names: list[str] = typer.Argument(None, help="host names to stop"),
    all_hosts: bool = typer.Option(False, "--all", help="stop every local host"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Stop hosts (their processes, namespace and registry entry), then remove their files (image store, logs)
    unless a migration still needs them, saying what was kept and why. Idempotent."""
    from gpumigrate.flows import cleanup

    if not names and not all_hosts:
        raise InvalidInputError("name the hosts to stop, or pass --all")
    if names and all_hosts:
        raise InvalidInputError("pass host names or --all, not both")
    provider = _provider()
    reaped = provider.reap_stale()
    up = {h.name for h in provider.list_hosts()}
    targets = sorted(up) if all_hosts else list(names)
    stopped, not_up, files = [], [], []
    for n in targets:
        if n in up:
            provider.terminate(n)
            stopped.append(n)
            console.print(f"down {n}")
        else:
            not_up.append(n)
            console.print(f"{n} was not up: nothing to stop" + (" (its supervisor had died)" if n in reaped else ""))
        for item in cleanup.remove(cleanup.host_files(n, up=False)):
            files.append(item.to_json())
            console.print(f"  {cleanup.describe(item)}", soft_wrap=True, highlight=False)
    for n in reaped:
        if n not in targets:
            console.print(f"cleaned up {n} (its supervisor had died)")
    if as_json:
        emit_json({"stopped": stopped, "not_up": not_up, "cleaned_up": reaped, "files": files})
