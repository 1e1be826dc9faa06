"""The sweeps' RELAYMPI_* settings: the environment, then the KEY=VALUE file $RELAYMPI_JOBS_CONFIG.

The one reader of these settings: jobs/grid.py uses ``JobSettings``, and jobs/lib.sh asks this file
for one value (``relaympi_cfg NAME [DEFAULT]`` runs ``python3 jobs/settings.py NAME [DEFAULT]``).
Standard library only, and Python 3.7 is enough: lib.sh reads the site's modules, prelude and
Python from here before any of them is set up.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

V = TypeVar("V")  # a setting's value, as its convert function makes it

CONFIG_VARIABLE = "RELAYMPI_JOBS_CONFIG"


class JobsError(ValueError):
    """A bad setting, or a sweep that cannot run as set (the message names the variable and
    value)."""


def parse_config_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; '#' starts a comment line; 'export ' and matching outer quotes are
    dropped."""
    values: dict[str, str] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise JobsError(
            f"{CONFIG_VARIABLE}={path}: cannot read ({error.strerror or error})"
        ) from None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise JobsError(f"{path}:{number}: expecting KEY=VALUE, got {raw!r}")
        value = value.rstrip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


class JobSettings:
    """RELAYMPI_* settings: a non-empty environment variable wins over the config file."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.values: dict[str, str] = {}
        config = environ.get(CONFIG_VARIABLE)
        if config:
            self.values.update(parse_config_file(Path(config)))
        self.values.update(
            {k: v for k, v in environ.items() if k.startswith("RELAYMPI_") and v != ""}
        )

    @overload
    def get(self, name: str, default: str) -> str: ...
    @overload
    def get(self, name: str, default: str | None = None) -> str | None: ...
    def get(self, name: str, default: str | None = None) -> str | None:
        value = self.values.get(name, "")
        return value if value != "" else default

    def list(self, name: str, convert: Callable[[str], V], default: Sequence[V]) -> tuple[V, ...]:
        value = self.get(name)
        if value is None:
            return tuple(default)
        try:
            return tuple(convert(item) for item in value.replace(",", " ").split())
        except ValueError:
            raise JobsError(
                f"{name}={value!r}: expecting a list of {convert.__name__} values"
            ) from None

    @overload
    def number(self, name: str, convert: Callable[[str], V]) -> V | None: ...
    @overload
    def number(self, name: str, convert: Callable[[str], V], default: V) -> V: ...
    def number(self, name: str, convert: Callable[[str], Any], default: Any = None) -> Any:
        value = self.get(name)
        if value is None:
            return default
        try:
            return convert(value)
        except ValueError:
            raise JobsError(f"{name}={value!r}: expecting {convert.__name__}") from None

    def flag(self, name: str) -> bool:
        value = (self.get(name) or "0").lower()
        if value not in ("0", "1", "true", "false", "yes", "no"):
            raise JobsError(f"{name}={value!r}: expecting 0 or 1")
        return value in ("1", "true", "yes")

    def path(self, name: str, default: Path) -> Path:
        value = self.get(name)
        return Path(value).expanduser().absolute() if value else default


def main(argv: Sequence[str]) -> int:
    """``NAME [DEFAULT]``: print the setting NAME (no newline), else DEFAULT, else nothing."""
    if not 1 <= len(argv) <= 2:
        print("usage: python3 jobs/settings.py NAME [DEFAULT]", file=sys.stderr)
        return 2
    try:
        value = JobSettings().get(argv[0], argv[1] if len(argv) == 2 else "")
    except JobsError as error:
        print(f"jobs/settings.py: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(value or "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
