"""`python -m benchmarks.report DIR`: the report (relaympi.report) under the name it always had."""

from __future__ import annotations

from relaympi.report import main

__all__ = ["main"]

if __name__ == "__main__":
    from relaympi.entrypoint import run

    run(lambda: main(prog="python -m benchmarks.report"))
