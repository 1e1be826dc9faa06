"""SLURM sweeps: the grid and dry runs (anywhere), then real submissions to a local cluster
(marker cluster).

The cluster tests need a reachable cluster: `bash cluster/local_cluster.sh install && bash
cluster/local_cluster.sh start` and the printed `export SLURM_CONF=...`.
"""

# Long module: the sweeps against a real SLURM cluster, one fixture for all

from __future__ import annotations

import csv
import functools
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from relaympi.results import read_run, run_status

# the grid and dry-run tests run jobs/ and the trainer as subprocesses; the cluster ones submit
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
SWEEPS = (
    "sweep_alpha",
    "sweep_workers",
    "sweep_lr",
    "sweep_drop",
    "sweep_imagenet",
    "sweep_agnews",
)
HAVE_TRAIN = importlib.util.find_spec("relaympi.train") is not None


def clean_env(**settings: str) -> dict[str, str]:
    """The environment without the caller's RELAYMPI_* settings, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYMPI_") and k != "DRY_RUN"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(settings)
    return env


def grid(*args: str, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.grid", *args],
        capture_output=True,
        text=True,
        env=clean_env(**settings),
        cwd=ROOT,
    )


def bash(
    script: str, *args: str, cwd: Path | str = ROOT, **settings: str
) -> subprocess.CompletedProcess:
    """Run a script of jobs/ by its name, or any script by its path from the repository root."""
    return subprocess.run(
        ["bash", str(ROOT / script if "/" in script else JOBS / script), *args],
        capture_output=True,
        text=True,
        env=clean_env(**settings),
        cwd=cwd,
    )


QUADRATICS = {  # a tiny sweep: 3 algorithms x 1 alpha x 1 seed, 2 workers in one process
    "RELAYMPI_TASK": "quadratics",
    "RELAYMPI_LAUNCHER": "local",
    "RELAYMPI_WORKERS": "2",
    "RELAYMPI_STEPS": "30",
    "RELAYMPI_EVAL_EVERY": "5",
    "RELAYMPI_SEEDS": "0",
    "RELAYMPI_ALGOS": "relay sgp allreduce",
    "RELAYMPI_ALPHAS": "0.1",
    "RELAYMPI_MOMENTA": "0",
}


# ------------------------------------------------------------------------------ grid, anywhere


@pytest.mark.parametrize("sweep", SWEEPS)
def test_header_array_matches_default_grid(sweep: str) -> None:
    header = (JOBS / f"{sweep}.sh").read_text()
    match = re.search(r"^#SBATCH --array=0-(\d+)$", header, re.MULTILINE)
    assert match, f"{sweep}.sh has no #SBATCH --array=0-N line"
    count = grid("count", sweep)
    assert count.returncode == 0, count.stderr
    assert int(match.group(1)) + 1 == int(count.stdout)
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=B:USR1@" in header


def test_sweep_scripts_are_written_from_the_grids() -> None:
    """jobs/sweep_*.sh are `python -m jobs.grid scripts`' (the grid and its #SBATCH defaults in
    jobs/sweeps.py); a plain sbatch from the checkout logs into results/logs/, which the checkout
    keeps (SLURM does not create it) and git ignores."""
    check = grid("scripts", "--check")
    assert check.returncode == 0, check.stderr
    for sweep in SWEEPS:
        assert (
            "\n#SBATCH --output=results/logs/%x-%A_%a.out\n" in (JOBS / f"{sweep}.sh").read_text()
        )
    assert (ROOT / "results" / "logs" / ".gitignore").read_text().splitlines()[1:] == [
        "*",
        "!.gitignore",
    ]


def test_paper_grids() -> None:
    out = grid("list", "sweep_alpha").stdout
    assert "90 configurations" in out
    commands = [line.strip() for line in out.splitlines() if line.startswith("    ")]
    assert len(commands) == 90
    # the trainer reads each configuration from its --config JSON: the listing's field lines show it
    fields = [line + " " for line in out.splitlines() if line.startswith("[")]
    relay = [
        c for c in fields if " algo=relay " in c and " alpha=0.01 " in c and " momentum=0.9 " in c
    ]
    assert len(relay) == 3 and all(
        " lr=0.15 " in c and " topology=double-binary-trees " in c for c in relay
    )
    assert all(c.startswith("srun --ntasks=16 ") for c in commands)
    assert not [c for c in fields if " algo=qgm " in c and " momentum=0.0 " in c]
    drop = grid("list", "sweep_drop").stdout
    assert " drop_prob=0.1\n" in drop and " algo=qgm topology=ring " in drop
    agnews = grid("list", "sweep_agnews", RELAYMPI_DATA="/data root").stdout
    assert " algo=relay topology=chain " in agnews and " optimizer=adam " in agnews
    assert " lr=0.0009 " in agnews
    config = json.loads(
        grid("config", "sweep_agnews", "--index", "1", RELAYMPI_DATA="/data root").stdout
    )
    assert (config["data_dir"], config["model_dir"]) == (
        "/data root/agnews",
        "/data root/distilbert",
    )
    workers = grid("plan", "sweep_workers", "--all", "--dry-run").stdout
    assert [line.split("\t")[1] for line in workers.splitlines() if line.startswith("group")] == [
        "16",
        "32",
        "64",
    ]


def test_lr_grid_and_overrides(tmp_path: Path) -> None:
    out = grid(
        "list",
        "sweep_lr",
        RELAYMPI_TASK="digits",
        RELAYMPI_ALGOS="relay",
        RELAYMPI_ALPHAS="0.1",
        RELAYMPI_MOMENTA="0",
        RELAYMPI_SEEDS="0",
        RELAYMPI_LR_CENTER="0.1",
        RELAYMPI_LR_KMIN="-1",
        RELAYMPI_LR_KMAX="2",
    ).stdout
    assert re.findall(r" lr=(\S+)", out) == ["0.05", "0.1", "0.2", "0.4"]
    missing = grid("list", "sweep_lr", RELAYMPI_TASK="digits")
    assert missing.returncode == 2 and "RELAYMPI_LR_CENTER" in missing.stderr
    bad = grid("list", "sweep_alpha", RELAYMPI_SEEDS="zero")
    assert bad.returncode == 2 and "RELAYMPI_SEEDS='zero'" in bad.stderr


def test_config_file_and_environment(tmp_path: Path) -> None:
    config = tmp_path / "site config.env"
    config.write_text(
        "# site settings\nexport RELAYMPI_SEEDS='0 1'\nRELAYMPI_ALGOS=relay\n"
        'RELAYMPI_LAUNCHER_ARGS="--mpi=pmix --cpu-bind=cores"\nRELAYMPI_PARTITION=gpu\n'
    )
    out = grid("list", "sweep_alpha", RELAYMPI_JOBS_CONFIG=str(config)).stdout
    assert "12 configurations" in out  # 2 seeds x relay (with and without momentum) x 3 alphas
    assert "srun --ntasks=16 --mpi=pmix --cpu-bind=cores " in out
    out = grid("list", "sweep_alpha", RELAYMPI_JOBS_CONFIG=str(config), RELAYMPI_SEEDS="5").stdout
    assert out.count("seed=5") == 6  # the environment wins over the file
    # the bash side reads the same file the same way
    probe = (
        f"source {shlex.quote(str(JOBS / 'lib.sh'))}; relaympi_cfg RELAYMPI_LAUNCHER_ARGS; echo; "
        "relaympi_cfg RELAYMPI_SEEDS; echo; relaympi_cfg RELAYMPI_TIME 1:00:00"
    )
    proc = subprocess.run(
        ["bash", "-c", probe],
        capture_output=True,
        text=True,
        env=clean_env(RELAYMPI_JOBS_CONFIG=str(config)),
    )
    assert proc.stdout.splitlines() == ["--mpi=pmix --cpu-bind=cores", "0 1", "1:00:00"]
    dry = bash(
        "submit.sh",
        "sweep_alpha",
        "--dry-run",
        RELAYMPI_JOBS_CONFIG=str(config),
        RELAYMPI_RESULTS_DIR=str(tmp_path / "r"),
        RELAYMPI_DATA_DIR=str(tmp_path),
    )
    assert dry.returncode == 0, dry.stderr
    assert "--partition=gpu" in dry.stderr and "--array=0-11 " in dry.stderr


def test_dry_run_lists_exact_commands(tmp_path: Path) -> None:
    results = tmp_path / "my results"
    for args, env in (((), {"DRY_RUN": "1"}), (("--dry-run",), {})):
        proc = bash("sweep_alpha.sh", *args, RELAYMPI_RESULTS_DIR=str(results), **QUADRATICS, **env)
        assert proc.returncode == 0, proc.stderr
        commands = [
            shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("    ")
        ]
        assert len(commands) == 3
        for command in commands:
            config = Path(command[command.index("--config") + 1])  # beside the run file
            # the space survived quoting
            assert config.parent == results / "sweep_alpha" / "quadratics"
            assert command[1:4] == ["-m", "relaympi.train", "--config"]
        assert "3 missing" in proc.stdout
    assert not results.exists()  # a dry run writes nothing


def test_run_needs_an_index_and_data() -> None:
    proc = bash("sweep_alpha.sh")
    assert proc.returncode == 2 and "jobs/submit.sh sweep_alpha" in proc.stderr
    proc = bash(
        "sweep_imagenet.sh", "--index", "0", RELAYMPI_LAUNCHER="local", RELAYMPI_DATA="/nonexistent"
    )
    assert proc.returncode == 2 and "imagenet in /nonexistent/imagenet: missing" in proc.stderr
    assert "prepare-imagenet" in proc.stderr
    proc = bash("sweep_alpha.sh", "--index", "999", **QUADRATICS)
    assert (
        proc.returncode == 2
        and "--index 999 is outside the grid of 3 configurations" in proc.stderr
    )


def test_submit_refuses_data_that_is_not_verified(tmp_path: Path) -> None:
    from relaympi.data import manifest
    from tests.data_factories import write_cifar10_binary

    root = tmp_path / "data root"
    small = {
        "RELAYMPI_DATA": str(root),
        "RELAYMPI_ALGOS": "relay",
        "RELAYMPI_ALPHAS": "0.1",
        "RELAYMPI_SEEDS": "0",
        "RELAYMPI_MOMENTA": "0",
        "RELAYMPI_RESULTS_DIR": str(tmp_path / "r"),
    }
    proc = bash("submit.sh", "sweep_alpha", **small)
    assert proc.returncode == 2 and "not present and verified" in proc.stderr
    assert f"python -m relaympi.data fetch cifar10 --root '{root}'" in proc.stderr
    dry = bash("submit.sh", "sweep_alpha", "--dry-run", **small)
    assert dry.returncode == 0 and "warning:" in dry.stderr and "--array=0 " in dry.stderr
    write_cifar10_binary(root / "cifar10", n_per_batch=2)  # by hand: complete, not verified
    proc = grid("plan", "sweep_alpha", **small)
    assert proc.returncode == 2 and "cifar10 in" in proc.stderr and "unverified" in proc.stderr
    assert grid("plan", "sweep_alpha", RELAYMPI_ALLOW_UNVERIFIED_DATA="1", **small).returncode == 0
    directory = root / "cifar10"
    manifest.write(directory, "cifar10", "test", files=manifest.file_records(directory))
    proc = grid("plan", "sweep_alpha", **small)
    assert proc.returncode == 0 and proc.stdout.startswith("group\t16\t0\t1"), proc.stderr
    (directory / "cifar-10-batches-bin" / "test_batch.bin").write_bytes(b"x")
    proc = grid("plan", "sweep_alpha", **small)
    assert proc.returncode == 2 and "corrupt" in proc.stderr


@pytest.mark.skipif(not HAVE_TRAIN, reason="relaympi.train is not available")
def test_local_run_is_idempotent(tmp_path: Path) -> None:
    settings = {**QUADRATICS, "RELAYMPI_RESULTS_DIR": str(tmp_path / "results dir")}
    first = bash("sweep_alpha.sh", "--index", "0", **settings)
    assert first.returncode == 0, first.stdout + first.stderr
    (out,) = (tmp_path / "results dir" / "sweep_alpha" / "quadratics").glob("relay_*.h5")
    assert run_status(out) == "completed"
    # the trainer's --config, beside the run file: the recorded command reruns it
    config_file = out.with_suffix(".json")
    assert shlex.split(read_run(out, datasets=()).provenance["command"])[-2:] == [
        "--config",
        str(config_file),
    ]
    assert json.loads(config_file.read_text())["out"] == str(out)
    mtime = out.stat().st_mtime_ns
    again = bash("sweep_alpha.sh", "--index", "0", **settings)
    assert again.returncode == 0 and "already completed; skipping" in again.stdout
    assert out.stat().st_mtime_ns == mtime
    plan = grid("plan", "sweep_alpha", **settings).stdout
    assert "group\t1\t1-2\t2" in plan and "finished\t1" in plan


@pytest.mark.skipif(not HAVE_TRAIN, reason="relaympi.train is not available")
def test_batched_backend_runs_each_configuration_as_one_process(tmp_path: Path) -> None:
    """RELAYMPI_BACKEND=batched: one process per configuration, the same numbers as the local
    backend."""
    batched = {
        **QUADRATICS,
        "RELAYMPI_BACKEND": "batched",
        "RELAYMPI_RESULTS_DIR": str(tmp_path / "batched"),
    }
    plan = grid("plan", "sweep_alpha", **batched).stdout
    # one GPU per configuration
    assert "group\t1\t0-2\t3" in plan and "sbatch\t--gpus-per-node=1" in plan
    # the site's own
    assert (
        "sbatch\t" not in grid("plan", "sweep_alpha", **batched, RELAYMPI_GPUS_PER_NODE="2").stdout
    )
    runs = {}
    for name, settings in (
        ("batched", {**batched, "RELAYMPI_DEVICE": "cpu"}),
        ("local", {**QUADRATICS, "RELAYMPI_RESULTS_DIR": str(tmp_path / "local")}),
    ):
        proc = bash("sweep_alpha.sh", "--index", "0", **settings)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (out,) = (tmp_path / name / "sweep_alpha" / "quadratics").glob("relay_*.h5")
        runs[name] = read_run(out)
    assert runs["batched"].config["backend"] == "batched" and runs["batched"].config["workers"] == 2
    for metric in ("suboptimality", "consensus_distance", "train_loss", "bytes_sent"):
        np.testing.assert_allclose(
            runs["batched"].metric(metric),
            runs["local"].metric(metric),
            rtol=1e-9,
            atol=1e-12,
            err_msg=metric,
        )


# ------------------------------------------------------------------------------- real cluster


@functools.cache
def _cluster_reason() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (bash cluster/local_cluster.sh install && start)"
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        return (
            f"SLURM_CONF={conf} does not exist (cluster/local_cluster.sh start prints the "
            "right one)"
        )
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"sinfo failed: {error}"
    states = proc.stdout.split()
    if proc.returncode != 0 or not any(
        s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states
    ):
        return (
            f"no reachable SLURM cluster (SLURM_CONF={os.environ.get('SLURM_CONF')}): "
            f"{proc.stderr.strip()[:200]}"
        )
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    reason = _cluster_reason()
    if reason:
        pytest.skip(reason)
    if not HAVE_TRAIN:
        pytest.skip("relaympi.train is not available")


def report_csv(results: Path, *args: str) -> dict[str, list[dict[str, str]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "relaympi.report", str(results), "--format", "csv", *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tables = {}
    for block in proc.stdout.split("\n\n"):
        if block.startswith("# ") and ":" in block.split("\n", 1)[0] and "\n" in block:
            name = block[2:].split(":", 1)[0]
            tables[name] = list(csv.DictReader(io.StringIO(block.split("\n", 1)[1])))
    return tables


def steps_to(path: Path, target: float) -> int | None:
    with h5py.File(path, "r") as file:
        steps, sub = file["step"][:], file["suboptimality"][:]
    hits = [int(s) for s, v in zip(steps, sub, strict=True) if v <= target]
    return hits[0] if hits else None


def wait_for(output: str, timeout_s: float = 120) -> None:
    """Poll squeue for the jobs that sbatch reported (faster than sbatch --wait's backoff)."""
    jobs = re.findall(r"Submitted batch job (\d+)", output) or re.findall(
        r"^(\d+)", output, re.MULTILINE
    )
    assert jobs, output
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "-h", "-j", ",".join(jobs)], capture_output=True, text=True
        )
        if not queue.stdout.strip():
            return
        time.sleep(0.5)
    pytest.fail(f"jobs {jobs} still queued after {timeout_s} s")


@pytest.fixture(scope="module")
def alpha_sweep(
    cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("slurm")
    settings = {**QUADRATICS, "RELAYMPI_RESULTS_DIR": str(root / "results dir")}
    proc = bash("submit.sh", "sweep_alpha", cwd=root, **settings)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(proc.stdout)
    return root / "results dir", settings


@pytest.mark.cluster
def test_sweep_alpha_and_report(alpha_sweep: tuple[Path, dict[str, str]]) -> None:
    results, _ = alpha_sweep
    files = sorted((results / "sweep_alpha" / "quadratics").glob("*.h5"))
    assert len(files) == 3 and all(run_status(f) == "completed" for f in files)
    assert not list((results / "checkpoints").rglob("*.pt"))  # removed after completion
    tables = report_csv(results, "--target", "1")
    (rows,) = [rows for name, rows in tables.items() if name.startswith("quadratics")]
    for path in files:
        algo = read_run(path, datasets=()).config["algo"]
        (row,) = [r for r in rows if r["algo"] == algo]
        assert row["world_size"] == "2"
        assert float(row["mean"]) == steps_to(path, 1.0)


@pytest.mark.cluster
def test_resubmission_reruns_only_what_is_missing(alpha_sweep: tuple[Path, dict[str, str]]) -> None:
    results, settings = alpha_sweep
    files = {
        read_run(f, datasets=()).config["algo"]: f
        for f in (results / "sweep_alpha" / "quadratics").glob("*.h5")
    }
    kept = files["allreduce"]
    kept_mtime = kept.stat().st_mtime_ns
    files["relay"].unlink()
    # as left by a preempted job whose checkpoint is gone
    with h5py.File(files["sgp"], "r+") as file:
        file.attrs["status"] = "preempted"
    plan = grid("plan", "sweep_alpha", **settings).stdout
    assert "finished\t1" in plan
    # every index again, straight through sbatch: the jobs themselves skip finished runs
    proc = subprocess.run(
        [
            "sbatch",
            "--array=0-2",
            "--ntasks=1",
            f"--output={results}/logs/resubmit-%a.out",
            str(JOBS / "sweep_alpha.sh"),
        ],
        capture_output=True,
        text=True,
        env=clean_env(**settings),
        cwd=results.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(proc.stdout)
    assert all(run_status(f) == "completed" for f in files.values())
    assert kept.stat().st_mtime_ns == kept_mtime
    logs = "".join(p.read_text() for p in (results / "logs").glob("resubmit-*.out"))
    assert logs.count("already completed; skipping") == 1
    for path in files.values():
        steps = read_run(path).metric("step")
        assert steps[-1] == 30 and (np.diff(steps) > 0).all()


def _cred_expire_s() -> int:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    match = re.search(r"cred_expire=(\d+)", out)
    return int(match.group(1)) if match else 120


@pytest.mark.cluster
def test_time_limit_warning_checkpoints_requeues_and_resumes(cluster: None, tmp_path: Path) -> None:
    if _cred_expire_s() > 30:
        pytest.skip(
            "the cluster delays requeued jobs by cred_expire > 30 s (local_cluster.sh sets 10 s)"
        )
    results = tmp_path / "results dir"
    settings = {
        **QUADRATICS,
        "RELAYMPI_ALGOS": "relay",
        "RELAYMPI_STEPS": "8000",
        "RELAYMPI_EVAL_EVERY": "200",
        "RELAYMPI_RESULTS_DIR": str(results),
    }
    proc = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0",
            "--ntasks=1",
            f"--output={tmp_path}/job.out",
            str(JOBS / "sweep_alpha.sh"),
        ],
        capture_output=True,
        text=True,
        env=clean_env(**settings),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    (out,) = [
        Path(c[c.index("--config") + 1]).with_suffix(".h5")
        for c in (
            shlex.split(line)
            for line in grid("list", "sweep_alpha", **settings).stdout.splitlines()
            if line.startswith("    ")
        )
    ]
    deadline = time.monotonic() + 60
    # wait for the first rows, then warn as SLURM does before the limit
    while time.monotonic() < deadline:
        if run_status(out) == "running" and read_run(out, datasets=["step"]).num_rows >= 2:
            break
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR1", f"{job}_0"], check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        queue = subprocess.run(
            ["squeue", "-h", "-j", job], capture_output=True, text=True
        ).stdout.strip()
        if not queue:
            break
        time.sleep(1)
    log = (tmp_path / "job.out").read_text()
    assert "requeueing SLURM job" in log, log[-3000:]
    run = read_run(out)
    assert run.status == "completed", log[-3000:]
    assert run.attrs["resumed_at_steps"], run.attrs
    steps = run.metric("step")
    assert steps[-1] == 8000 and (np.diff(steps) > 0).all()  # resumed rows are not duplicated


@pytest.mark.cluster
def test_sweep_lr_on_digits(cluster: None, tmp_path: Path) -> None:
    results = tmp_path / "lr results"
    settings = {
        "RELAYMPI_TASK": "digits",
        "RELAYMPI_LAUNCHER": "local",
        "RELAYMPI_WORKERS": "2",
        "RELAYMPI_STEPS": "20",
        "RELAYMPI_EVAL_EVERY": "10",
        "RELAYMPI_SEEDS": "0",
        "RELAYMPI_ALGOS": "relay",
        "RELAYMPI_ALPHAS": "0.1",
        "RELAYMPI_MOMENTA": "0",
        "RELAYMPI_LR_CENTER": "0.1",
        "RELAYMPI_LR_KMIN": "-1",
        "RELAYMPI_LR_KMAX": "1",
        "RELAYMPI_RESULTS_DIR": str(results),
    }
    proc = bash("submit.sh", "sweep_lr", cwd=tmp_path, **settings)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wait_for(proc.stdout)
    files = sorted((results / "sweep_lr" / "digits").glob("*.h5"))
    assert len(files) == 3
    metric = {}
    # the paper's metric by hand: runs are < 1 epoch, so all evaluations after epoch 0
    for path in files:
        run = read_run(path)
        keep = run.metric("epoch") > 0
        metric[run.config["lr"]] = run.metric("test_accuracy")[keep].mean(axis=0).min()
    tables = report_csv(results)
    (lr_rows,) = [rows for name, rows in tables.items() if name.startswith("lr_")]
    (row,) = lr_rows
    best = max(metric, key=lambda lr: metric[lr])
    assert float(row["lr"]) == best
    assert row["lr_grid"] == "0.05 0.1 0.2"
    assert row["lr_sandwiched"] == str(best == 0.1)
    (acc_rows,) = [rows for name, rows in tables.items() if name.startswith("accuracy_")]
    assert float(acc_rows[0]["mean"]) == pytest.approx(metric[best])
