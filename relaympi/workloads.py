"""Kept for importers of the old path: a worker's workload now lives in relaympi.training.workloads."""

from relaympi.training.workloads import (
    ModelWorkload,
    QuadraticWorkload,
    Workload,
    build_workload,
    model_workload,
    run_partition,
)

__all__ = ["ModelWorkload", "QuadraticWorkload", "Workload", "build_workload", "model_workload", "run_partition"]
