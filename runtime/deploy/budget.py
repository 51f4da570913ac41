"""How many GPUs a deployment runs on, and the check against its planner.gpu_budget.

One rule for `pdserve tune`, the pipeline's tune step and the demo's pre-flight check.
"""

from __future__ import annotations

from runtime.config import DeploymentSpec


class GpuBudgetError(ValueError):
    """The tuned deployment needs more GPUs than its planner.gpu_budget; the message has both numbers."""


def deployment_gpus(spec: DeploymentSpec) -> int:
    """GPUs a DeploymentSpec runs on: replicas × GPUs per worker (tp × dp × pp) of the prefill pool plus the same
    of the decode pool."""
    return spec.prefill.replicas * spec.prefill.gpus + spec.decode.replicas * spec.decode.gpus


def check_gpu_budget(spec: DeploymentSpec) -> int:
    """Return `deployment_gpus(spec)` when it fits `spec.planner.gpu_budget`.

    Raises:
        GpuBudgetError: it does not (message: the P:D replicas and GPUs per worker, GPUs needed, the budget).
    """
    need = deployment_gpus(spec)
    budget = spec.planner.gpu_budget
    if need > budget:
        raise GpuBudgetError(
            f"the tuned deployment needs {need} GPUs (P:D replicas {spec.prefill.replicas}:{spec.decode.replicas} "
            f"at {spec.prefill.gpus} prefill, {spec.decode.gpus} decode GPUs per worker) but planner.gpu_budget is "
            f"{budget} GPU{'' if budget == 1 else 's'}"
        )
    return need
