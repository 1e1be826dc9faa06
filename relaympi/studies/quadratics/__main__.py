"""The command line of relaympi.studies.quadratics (usage in the package docstring)."""

from __future__ import annotations

import logging
from pathlib import Path

from threadpoolctl import threadpool_limits

import relaympi.studies.quadratics
from relaympi.entrypoint import UsageParser, run
from relaympi.provenance import collect
from relaympi.studies.quadratics.findings import report, write_result
from relaympi.studies.quadratics.studies import STUDIES, TABLE, run_study

DEFAULT_OUT = Path("bench-results/quadratics")


def main(argv: list[str] | None = None) -> int:
    parser = UsageParser(
        prog="python -m relaympi.studies.quadratics",
        description=relaympi.studies.quadratics.__doc__.splitlines()[0],
    )
    parser.add_argument("study", choices=(*STUDIES, "all"))
    parser.add_argument(
        "--quick", action="store_true", help="reduced settings (smoke test, < 1 minute for all)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for the HDF5 files (default {DEFAULT_OUT})",
    )
    parser.add_argument("--seed", type=int, default=0, help="problem and noise seed")
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="fig2: problem seeds --seed, --seed+1, ... (default 10; quick 2)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="cap on gradient steps per run (default: the study's, 20000 or 10000; quick 2000)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every tuned run")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s"
    )

    provenance = collect({"backend": "matrix"})
    studies = STUDIES if args.study == "all" else (args.study,)
    # The engine's matrices are small: BLAS threads only contend (up to 100x slower on 2 cores).
    with threadpool_limits(1, user_api="blas"):
        for study in studies:
            result = run_study(
                study, quick=args.quick, seed=args.seed, max_steps=args.max_steps, seeds=args.seeds
            )
            path = write_result(result, args.out, provenance)
            print(report(result))
            print(f"wrote {path}", flush=True)
            draw = TABLE[study].figure
            if draw is not None:
                print(f"wrote {draw(result, args.out)}", flush=True)
            print(flush=True)
    return 0


if __name__ == "__main__":
    run(main)
