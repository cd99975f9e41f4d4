"""The whole plan: its sections, and the rules that span more than one of them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gpumigrate.plan.base import PlanModel
from gpumigrate.plan.parity import Parity
from gpumigrate.plan.policy import Cost, DataPolicy
from gpumigrate.plan.snapshot_transfer import TARGET_RECEIVER_RE, Snapshot, Transfer
from gpumigrate.plan.target import Target
from gpumigrate.plan.traffic import Traffic
from gpumigrate.plan.workload import Workload


class Plan(PlanModel):
    version: Literal[1] = 1
    workload: Workload
    target: Target
    data: DataPolicy
    snapshot: Snapshot = Field(default_factory=Snapshot)
    transfer: Transfer
    parity: Parity = Field(default_factory=Parity)
    traffic: Traffic = Field(default_factory=Traffic)
    cost: Cost = Field(default_factory=Cost)

    @model_validator(mode="after")
    def _cross(self) -> Plan:
        # Messages of rules that span sections start with the field they ask for: parse_plan reports
        # them under that path.
        if self.snapshot.backend == "agent" and self.workload.launch is None:
            raise ValueError(
                "workload.launch: required with snapshot.backend agent: how gpumigrate starts the workload on the "
                "target (argv, env, cwd; see examples/byo/plan.yaml for a service, examples/train/plan.yaml for "
                "a training loop)"
            )
        if self.parity.golden_inputs is not None and self.parity.request is None:
            raise ValueError(
                "parity.request: required with parity.golden_inputs: the method and path each golden input is "
                "sent to, the request body, and which fields of the answer are compared (see examples/byo/plan.yaml)"
            )
        stream = self.parity.stream
        if stream is not None and self.parity.golden_inputs is None and _has_placeholder(stream.body):
            raise ValueError(
                "parity.golden_inputs: required when parity.stream.body has placeholders ('{name}' strings are filled "
                "from the golden cases); or write the streamed request's body out in full"
            )
        if self.snapshot.backend == "cuda-driver" and self.target.provider != "local":
            raise ValueError(
                "snapshot.backend cuda-driver restores on the same host only: use agent or criu across hosts"
            )
        boot = self.target.bootstrap
        if boot is not None and self.transfer.encryption_key is not None and boot.image_key_secret is None:
            raise ValueError(
                "target.bootstrap.image_key_secret is needed: the target must read the image key "
                "(transfer.encryption_key) from a secrets manager to restore the image"
            )
        gpus = self.target.rank_gpus
        if gpus is not None and len(gpus) != self.workload.ranks:
            raise ValueError(
                f"target.rank_gpus: lists {len(gpus)} GPU(s) for a workload of {self.workload.ranks} rank(s) "
                "(workload.ranks): one GPU per rank, rank 0's first"
            )
        launch_env = self.workload.launch.env if self.workload.launch is not None else {}
        if gpus is not None and "CUDA_VISIBLE_DEVICES" in launch_env:
            raise ValueError(
                "target.rank_gpus: the launch's env sets CUDA_VISIBLE_DEVICES too; say the ranks' GPUs in one place"
            )
        if self.transfer.restore_from == "source" and (
            self.snapshot.backend != "agent" or self.target.provider != "local"
        ):
            raise ValueError(
                "transfer.restore_from: source needs snapshot.backend agent and a local target on the source's host "
                "(the target copies the source's memory; target rank r from source rank r); use store to load the "
                "image from the store"
            )
        if TARGET_RECEIVER_RE.match(self.transfer.store) and self.target.provider != "local":
            raise ValueError(
                f"transfer.store {self.transfer.store} starts a receiver on the target, which gpumigrate does on "
                f"local hosts only: for a {self.target.provider} target use a bucket in its region (s3://, gs://) "
                "or a receiver you run there (stream://HOST:PORT?fingerprint=sha256:HEX)"
            )
        return self


def _has_placeholder(template: Any) -> bool:
    """Whether a body template holds a string that is exactly ``{name}`` (parity/request.py fills those)."""
    if isinstance(template, str):
        return len(template) > 2 and template[0] == "{" and template[-1] == "}" and template[1:-1].isidentifier()
    if isinstance(template, dict):
        return any(_has_placeholder(v) for v in template.values())
    if isinstance(template, list):
        return any(_has_placeholder(v) for v in template)
    return False
