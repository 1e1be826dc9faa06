"""Mutation check: plant known bugs one at a time in a copy of the repository and see which tests
catch them.

    python scripts/mutants.py                 # every plant; exit 1 if any survived or errored
    python scripts/mutants.py --list          # the plants, without running anything
    python scripts/mutants.py report- relay-  # only plants whose name starts with one of these

Each plant is (name, file, exact old snippet, new snippet, test selection). The tracked files of
the working tree (git ls-files, with uncommitted edits) are copied to a temporary folder, the
snippet is replaced there, and ``pytest -x -q <selection>`` runs in the copy with PYTHONPATH set
to it. Outcomes: ``killed`` (a selected test failed; the first failing test is named),
``survived`` (all selected tests passed: the tests miss this bug), ``ERROR`` (the snippet is not
found exactly once, the selection collects nothing, or pytest broke down). An ERROR means the
plant no longer matches the code: update its snippet when the code it targets is rewritten.
Before planting, every distinct selection runs once on the unmodified copy (skip with
``--no-baseline``); a failing baseline is an ERROR for its plants, since a kill would prove nothing.

Not collected by pytest (the name does not start with ``test_``) and not run by CI: it takes
minutes. Test files a selection names that do not exist yet are left out and listed in the note.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DROP_ORACLE = "tests/test_algorithms_with_drops.py"  # every algorithm against the lossy model
SCHEDULE = "tests/test_schedule.py"  # the run's rules against values counted by hand


@dataclass(frozen=True)
class Plant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[tuple[str, ...], ...]  # pytest runs, in order until one fails: files, node ids, -k


# -- the plants: edit the snippets here when the code they target changes -----------------------
PLANTS = (
    Plant(
        # a lost message's weight silently vanishes: rows no longer sum to 1
        "gossip-no-renormalize",
        "relaympi/algorithms/gossip.py",
        "total = self.self_weight + sum(self.weights[j] for j in delivered)",
        "total = 1.0",
        ((DROP_ORACLE,), ("tests/test_algorithms.py", "tests/test_comm.py")),
    ),
    Plant(
        # a lost message leaves the buffer's old content instead of being empty
        "relaysum-stale-on-drop",
        "relaympi/algorithms/relaysum.py",
        "                if peer not in delivered:\n                    "
        "layer.received[layer.row_of[position]].zero_()",
        "                if peer not in delivered:\n                    pass",
        ((DROP_ORACLE,), ("tests/test_algorithms.py", "-k", "relay")),
    ),
    Plant(
        # a leaf's message [p, c] (the parcel's spare slot) claims no parcel
        "relaysum-leaf-counter-0",
        "relaympi/flat.py",
        "storage[0] = storage[-1] = 1.0",
        "storage[0] = storage[-1] = 0.0",
        (("tests/test_algorithms.py", "-k", "relay"),),
    ),
    Plant(
        "relaysum-echo",  # degree 2: the message to a carries a's own last message back
        "relaympi/algorithms/relaysum.py",
        "targets[layer.row_of[1]], targets[layer.row_of[0]] = nbrs[0], nbrs[1]",
        "targets[layer.row_of[0]], targets[layer.row_of[1]] = nbrs[0], nbrs[1]",
        (("tests/test_algorithms.py", "-k", "relay"),),
    ),
    Plant(
        "relaysum-echo-hub",  # degree >= 3: m_ij = everything received, m_ji not subtracted
        "relaympi/algorithms/relaysum.py",
        "torch.sub(total[block], rows[:, block], out=rows[:, block])",
        "torch.add(total[block], 0 * rows[:, block], out=rows[:, block])",
        (("tests/test_algorithms.py", "-k", "relay"),),
    ),
    Plant(
        "relay-divide-by-n",  # counts mode: divide by n instead of n-bar (the parcels received)
        "relaympi/algorithms/relay.py",
        "self.relay.add_received(x, divide_by=[self.relay.factor(nbar, layer) for layer, "
        "nbar in enumerate(counts)])",
        "self.relay.add_received(x, divide_by=[float(self.topology.world_size)] * len(counts))",
        (("tests/test_algorithms.py", "-k", "relay"),),
    ),
    Plant(
        "drop-policy-asymmetric",  # the receiver asks about (dst, src): the two sides disagree
        "relaympi/comm/base.py",
        "live_recvs = {p: b for p, b in recvs.items() if not self.drops.dropped(round, "
        "tag, p, self.rank)}",
        "live_recvs = {p: b for p, b in recvs.items() if not self.drops.dropped(round, "
        "tag, self.rank, p)}",
        (("tests/test_comm.py", "-k", "drop"),),
    ),
    Plant(
        "relay-previous-sign",  # robust rule: adds u(t) for each missing parcel instead of x(t)
        "relaympi/algorithms/relay.py",
        "_add_scaled(xs, self.relay.coords(u, layer), -missing)",
        "_add_scaled(xs, self.relay.coords(u, layer), missing)",
        (("tests/test_algorithms.py", "-k", "relay"),),
    ),
    Plant(
        # the in-place exchange's receive side asks about (dst, src)
        "drop-policy-asymmetric-replace",
        "relaympi/comm/base.py",
        "recv = not self.drops.dropped(round, tag, peer, self.rank)",
        "recv = not self.drops.dropped(round, tag, self.rank, peer)",
        (("tests/test_comm.py", "-k", "drop or replace"),),
    ),
    Plant(
        "dirichlet-no-half-share-redraw",  # keeps the first draw even if a worker got too little
        "relaympi/tasks/partition.py",
        "return cuts if sizes.min() >= 0.5 * share else None",
        "return cuts",
        (("tests/test_partition.py",),),
    ),
    Plant(
        "dirichlet-no-share-cap",  # full workers keep drawing from later classes
        "relaympi/tasks/partition.py",
        "proportions = np.where(sizes < share, proportions, 0.0)",
        "proportions = np.where(sizes < 2 * share, proportions, 0.0)",
        (("tests/test_partition.py",),),
    ),
    Plant(
        "dirichlet-concentration",  # Dir(alpha n) instead of Dir(alpha): far less heterogeneous
        "relaympi/tasks/partition.py",
        "proportions = rng.dirichlet(np.full(workers, alpha))",
        "proportions = rng.dirichlet(np.full(workers, alpha * workers))",
        (("tests/test_partition.py",),),
    ),
    Plant(
        "report-min-mean-swapped",  # worst-worker tasks get the mean over workers and vice versa
        "relaympi/report/summary.py",
        'return float(np.nanmin(means) if metric == "worst" else np.nanmean(means))',
        'return float(np.nanmean(means) if metric == "worst" else np.nanmin(means))',
        (("tests/test_report.py",),),
    ),
    Plant(
        "report-worst-per-evaluation",  # worst worker at each evaluation, then the window mean
        "relaympi/report/summary.py",
        "    means = worker_means(epoch, accuracy, last_epochs)\n",
        '    reduce = np.nanmin if metric == "worst" else np.nanmean\n'
        "    means = worker_means(epoch, reduce(accuracy.reshape(len(accuracy), -1), "
        "axis=1), last_epochs)\n",
        (("tests/test_report.py",),),
    ),
    Plant(
        "report-window-by-evaluations",  # the last 5 evaluations instead of the last 5 epochs
        "relaympi/report/summary.py",
        "window = (epoch > final - last_epochs) & (epoch > 0)",
        "window = np.arange(len(epoch)) >= len(epoch) - int(last_epochs)",
        (("tests/test_report.py",),),
    ),
    Plant(
        "d2-exact-diffusion-matrix",  # (2W + I)/3 instead of the paper's (W + I)/2
        "relaympi/algorithms/d2.py",
        "w = (w + np.eye(w.shape[0])) / 2",
        "w = (2 * w + np.eye(w.shape[0])) / 3",
        (("tests/test_algorithms.py", "-k", "d2"),),
    ),
    Plant(
        "nesterov-swapped",  # u = -lr (m + beta g) instead of the paper's -lr (g + beta m)
        "relaympi/optim.py",
        "torch.add(g, m, alpha=beta, out=u)",
        "torch.add(m, g, alpha=beta, out=u)",
        (("tests/test_optim.py",),),
    ),
    Plant(
        "adam-no-bias-correction",  # Adam without the first moment's bias correction
        "relaympi/optim.py",
        "u.mul_(-lr / bias1)",
        "u.mul_(-lr)",
        (("tests/test_optim.py",),),
    ),
    # the rules that shape a run: lr schedule, step accounting, cadence, lr correction
    Plant(
        # linear warm-up one step ahead: step 0 already at warmup_from + 1/warmup_steps
        "schedule-warmup-ahead",
        "relaympi/training/plan.py",
        "(1.0 - self.warmup_from) * step / self.warmup_steps",
        "(1.0 - self.warmup_from) * (step + 1) / self.warmup_steps",
        ((SCHEDULE,),),
    ),
    Plant(
        "schedule-milestone-late",  # the /10 of a milestone applied one step after it
        "relaympi/training/plan.py",
        "decays = sum(step >= m for m in self.milestone_steps)",
        "decays = sum(step > m for m in self.milestone_steps)",
        ((SCHEDULE,),),
    ),
    Plant(
        "schedule-warmup-one-worker",  # the centralized baseline (one worker) warms up too
        "relaympi/training/plan.py",
        "if self.world_size > 1 else 0",
        "if self.world_size > 0 else 0",
        ((SCHEDULE,),),
    ),
    Plant(
        # --epochs 1.1 of 90 steps runs 100 steps (ceil of 99.00000000000001)
        "schedule-epochs-float-ceil",
        "relaympi/training/plan.py",
        "math.ceil(Fraction(repr(float(epochs))) * steps_per_epoch)",
        "math.ceil(epochs * steps_per_epoch)",
        ((SCHEDULE,),),
    ),
    Plant(
        # the last, partial batch round of an epoch is not counted
        "schedule-steps-per-epoch-floor",
        "relaympi/tasks/partition.py",
        "return math.ceil(num_train / (world_size * batch_size))",
        "return max(1, num_train // (world_size * batch_size))",
        ((SCHEDULE,),),
    ),
    Plant(
        # a run whose length is no multiple of --eval-every ends unevaluated
        "cadence-last-step-not-evaluated",
        "relaympi/training/loop.py",
        "if step % schedule.eval_every == 0 or step == schedule.total_steps:",
        "if step % schedule.eval_every == 0:",
        ((SCHEDULE,),),
    ),
    Plant(
        "cadence-eval-off-by-one",  # evaluates before steps eval_every - 1, 2 eval_every - 1, ...
        "relaympi/training/loop.py",
        "if step % schedule.eval_every == 0 or step == schedule.total_steps:",
        "if (step + 1) % schedule.eval_every == 0 or step == schedule.total_steps:",
        ((SCHEDULE,),),
    ),
    Plant(
        "cadence-eval-from-resume",  # a resumed run counts evaluations from where it resumed
        "relaympi/training/loop.py",
        "if step % schedule.eval_every == 0 or step == schedule.total_steps:",
        "if (step - self.start_step) % schedule.eval_every == 0 or step == schedule.total_steps:",
        ((SCHEDULE,),),
    ),
    Plant(
        # --checkpoint-every ignored: checkpoints at every evaluation
        "cadence-checkpoint-at-evaluations",
        "relaympi/training/loop.py",
        "step % schedule.checkpoint_every == 0:",
        "step % schedule.eval_every == 0:",
        ((SCHEDULE,),),
    ),
    Plant(
        # the checkpoint step's row survives the resume and is written twice
        "cadence-resume-keeps-checkpoint-row",
        "relaympi/training/run_file.py",
        "RunWriter.reopen(out, resume_step=start_step - 1)",
        "RunWriter.reopen(out, resume_step=start_step)",
        ((SCHEDULE,),),
    ),
    Plant(
        "lr-correction-inverted",  # lr / factor instead of lr * factor
        "relaympi/training/plan.py",
        "lr = float(cfg.lr) * (lr_correction(topology) if cfg.relay_lr_correction else 1.0)",
        "lr = float(cfg.lr) * (1.0 / lr_correction(topology) if cfg.relay_lr_correction else 1.0)",
        ((SCHEDULE,),),
    ),
    Plant(
        # every RelaySGD run corrected, with or without --relay-lr-correction
        "lr-correction-unasked",
        "relaympi/training/plan.py",
        "(lr_correction(topology) if cfg.relay_lr_correction else 1.0)",
        '(lr_correction(topology) if cfg.algo == "relay" else 1.0)',
        ((SCHEDULE,),),
    ),
    Plant(
        "lr-correction-twice",  # the schedule corrects the already corrected lr again
        "relaympi/training/plan.py",
        "            lr=self.lr,\n",
        "            lr=self.lr * (lr_correction(self.topology) if "
        "cfg.relay_lr_correction else 1.0),\n",
        ((SCHEDULE,),),
    ),
)

RESULT_LINE = re.compile(r"^(FAILED|ERROR) (\S+)")


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():  # deleted in the working tree but still in the index: skip
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _selections(plant: Plant, copy: Path) -> tuple[list[list[str]], list[str]]:
    """The plant's pytest runs without the test files missing from the copy, and those files.

    A run left with no test file at all is dropped.
    """
    runs, missing = [], []
    for run in plant.tests:
        args = []
        for arg in run:
            path = arg.split("::")[0]
            if path.startswith("tests/") and not (copy / path).exists():
                missing.append(path)
            else:
                args.append(arg)
        if any(a.startswith("tests/") for a in args):
            runs.append(args)
    return runs, missing


def _pytest(copy: Path, args: list[str], timeout_s: int, per_test_s: int) -> tuple[int | None, str]:
    env = dict(
        os.environ,
        PYTHONPATH=str(copy),
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        RELAYMPI_TEST_SLURM="0",
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        f"--timeout={per_test_s}",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this pytest started, nothing else
        out, _ = proc.communicate()
        return None, out


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        match = RESULT_LINE.match(line)
        if match:
            return match.group(2)
    return "?"


def _plant(copy: Path, plant: Plant) -> str | None:
    """Replace the snippet in the copy; the error text when it is not there exactly once."""
    path = copy / plant.file
    if not path.is_file():
        return f"no file {plant.file}"
    text = path.read_text()
    count = text.count(plant.old)
    if count != 1:
        return f"snippet found {count} times in {plant.file} (expected once): update the plant"
    path.write_text(text.replace(plant.old, plant.new))
    return None


def _judge(code: int | None, output: str) -> tuple[str, str]:
    if code is None:
        return "killed", "timeout: the selection hung (no failing test named)"
    if code == 0:
        return "survived", ""
    if code == 1:
        return "killed", _first_failure(output)
    if code == 5:
        return "ERROR", "the selection collects no tests"
    tail = " | ".join(output.strip().splitlines()[-3:])
    return "ERROR", f"pytest exit {code}: {tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", help="run only plants whose name starts with one of these"
    )
    parser.add_argument("--list", action="store_true", help="print the plants and exit")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmodified run of each selection"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per plant (default 900)")
    parser.add_argument(
        "--test-timeout", type=int, default=300, help="seconds per test (default 300)"
    )
    args = parser.parse_args(argv)
    plants = [p for p in PLANTS if not args.names or any(p.name.startswith(n) for n in args.names)]
    if not plants:
        parser.error(f"no plant starts with {' or '.join(args.names)}; see --list")
    if args.list:
        for p in plants:
            print(f"{p.name:32} {p.file:34} {' ; '.join(' '.join(run) for run in p.tests)}")
        return 0

    rows: list[tuple[str, str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="relaympi-mutants-") as tmp:
        pristine = Path(tmp) / "pristine"
        _copy_repo(pristine)
        baseline: dict[tuple[str, ...], str] = {}  # failing unmodified runs: why
        if not args.no_baseline:
            distinct = dict.fromkeys(tuple(r) for p in plants for r in _selections(p, pristine)[0])
            for run in distinct:
                code, out = _pytest(pristine, list(run), args.timeout, args.test_timeout)
                if code != 0:
                    result, detail = _judge(code, out)
                    baseline[run] = f"fails without any plant: {' '.join(run)} ({detail or result})"
                print(
                    f"baseline {' '.join(run)}: {'ok' if code == 0 else 'FAILS'}", file=sys.stderr
                )
        for plant in plants:
            start = time.monotonic()
            copy = Path(tmp) / plant.name
            shutil.copytree(pristine, copy)
            runs, missing = _selections(plant, copy)
            note = f" (not present: {', '.join(missing)})" if missing else ""
            error = _plant(copy, plant)
            bad_baseline = [baseline[tuple(r)] for r in runs if tuple(r) in baseline]
            if error:
                result, detail = "ERROR", error
            elif not runs:
                result, detail = "ERROR", "none of the selected test files exists"
            elif bad_baseline:
                result, detail = "ERROR", bad_baseline[0]
            else:
                for selection in runs:
                    result, detail = _judge(
                        *_pytest(copy, selection, args.timeout, args.test_timeout)
                    )
                    if result != "survived":
                        break
            rows.append((plant.name, result, detail + note, time.monotonic() - start))
            print(f"{plant.name}: {result} {detail}{note}", file=sys.stderr)
            shutil.rmtree(copy, ignore_errors=True)

    width = max(len(r[0]) for r in rows)
    print(f"{'plant':{width}}  {'result':8}  {'time':>5}  killed by / note")
    for name, result, detail, seconds in rows:
        print(f"{name:{width}}  {result:8}  {seconds:4.0f}s  {detail}")
    counts = {k: sum(r[1] == k for r in rows) for k in ("killed", "survived", "ERROR")}
    print(
        f"{counts['killed']} killed, {counts['survived']} survived, {counts['ERROR']} "
        f"errors of {len(rows)} plants"
    )
    return 0 if counts["survived"] == counts["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
