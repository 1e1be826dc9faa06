"""The paper's sweeps as SLURM job arrays: python -m jobs.grid (see jobs/README.md)."""
