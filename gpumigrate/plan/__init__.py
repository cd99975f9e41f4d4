"""The migration plan: a YAML file validated into typed pydantic models.

Every validation problem is reported with its field path (``target.region``,
``traffic.stages[2].weight``) and what is allowed, and the CLI turns it into exit code 2.
The plan never holds secrets: encryption keys are named by reference (an env var or a file).

One module per concern; every public name is importable from here:

    base.py               PlanModel (strict, frozen), the HTTP path check, KeyRef (a secret by reference)
    workload.py           workload: Workload, its Launch on a target and the launch placeholders
    target.py             target: Target, TargetNetwork, TargetBootstrap (cloud targets), GPU_MODELS
    policy.py             data and cost: DataPolicy (residency), Cost (cost-driven moves)
    snapshot_transfer.py  snapshot and transfer: Snapshot, Transfer (store and receiver URLs, bounds)
    parity.py             parity: Parity, ParityRequest, FieldCheck, StreamRequest, TrainingParity
    traffic.py            traffic: Traffic, Stage, Gates
    document.py           Plan: the sections together, and the rules that span several of them
    loading.py            load_plan, parse_plan (field paths, closest-field hints), resolve_relative
"""

from gpumigrate.plan.base import KeyRef
from gpumigrate.plan.document import Plan
from gpumigrate.plan.loading import MAX_ALIASES, load_plan, parse_plan, resolve_relative
from gpumigrate.plan.parity import FieldCheck, Parity, ParityRequest, StreamRequest, TrainingParity
from gpumigrate.plan.policy import Cost, DataPolicy
from gpumigrate.plan.snapshot_transfer import Snapshot, Transfer
from gpumigrate.plan.target import GPU_MODELS, Target, TargetBootstrap, TargetNetwork
from gpumigrate.plan.traffic import Gates, Stage, Traffic
from gpumigrate.plan.workload import LAUNCH_PLACEHOLDERS, Endpoint, Launch, Workload

__all__ = [
    "GPU_MODELS",
    "LAUNCH_PLACEHOLDERS",
    "MAX_ALIASES",
    "Cost",
    "DataPolicy",
    "Endpoint",
    "FieldCheck",
    "Gates",
    "KeyRef",
    "Launch",
    "Parity",
    "ParityRequest",
    "Plan",
    "Snapshot",
    "Stage",
    "StreamRequest",
    "Target",
    "TargetBootstrap",
    "TargetNetwork",
    "Traffic",
    "TrainingParity",
    "Transfer",
    "Workload",
    "load_plan",
    "parse_plan",
    "resolve_relative",
]
