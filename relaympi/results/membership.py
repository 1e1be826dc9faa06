"""Membership changes of a run (``--on-failure continue``, and the rerun that re-admits the lost
workers): the ``membership`` attribute's records, which workers each row holds, and how the changes
read in words."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MEMBERSHIP_ATTR = "membership"  # root attribute: a JSON list of the records below, in order
# One record per change: the step from which the lost workers take no part (their columns are NaN
# from that step's row on), their original ranks, nodes and hosts, the workers left after it, and
# the seconds from the failure being noticed to the first step on the new membership.
RECORD_KEYS = ("step", "lost", "lost_nodes", "lost_hosts", "world_size", "heal_s")
# A rerun on the starting worker count re-admits the lost workers at its checkpoint's step: its
# record has this key too (the re-admitted original ids, each lost before and not re-admitted
# since), empty lost/lost_nodes/lost_hosts, and world_size grown by them. Records without the key
# (every record of a file written before re-admission existed) are losses.
READMITTED_KEY = "readmitted"
# --peer-timeout: those of the lost workers that were evicted for silence (their process was still
# there, stalled), and the longest any survivor waited for them in seconds; heal_s then counts from
# the start of that wait. Both keys or neither, only in a loss record that evicts.
STALLED_KEY, SILENT_KEY = "stalled", "silent_s"
OPTIONAL_KEYS = (READMITTED_KEY, STALLED_KEY, SILENT_KEY)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_record(
    record: Mapping[str, Any], world_size: int, earlier: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """One membership record, checked against the run's starting ``world_size`` and the
    ``earlier`` records, as plain JSON-able values.

    Raises:
        ValueError: a missing, unknown or ill-typed key, a worker id out of range or already lost,
            a step before an earlier record's, or a ``world_size`` that is not the workers left;
            the message names the key.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a membership record must be a dict, got {type(record).__name__}")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise ValueError(f"membership record: missing key {missing[0]!r} (needs {RECORD_KEYS})")
    unknown = sorted(set(record) - set(RECORD_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise ValueError(
            f"membership record: unknown key {unknown[0]!r} (knows {RECORD_KEYS + OPTIONAL_KEYS})"
        )
    step = record["step"]
    if not _is_int(step) or step < 0:
        raise ValueError(f"membership record: 'step' must be an integer >= 0, got {step!r}")
    readmitted = record.get(READMITTED_KEY, [])
    if not _worker_list(readmitted, world_size):
        raise ValueError(
            f"membership record: {READMITTED_KEY!r} must be a list of distinct worker ids in "
            f"[0, {world_size}), got {readmitted!r}"
        )
    lost = record["lost"]
    if readmitted:
        if not isinstance(lost, (list, tuple)) or len(lost):
            raise ValueError(
                f"membership record: 'lost' must be [] in a record that re-admits workers "
                f"(a record may not both lose and re-admit), got {lost!r}"
            )
    elif not _worker_list(lost, world_size) or not lost:
        raise ValueError(
            "membership record: 'lost' must be a non-empty list of distinct worker ids in "
            f"[0, {world_size}), got {lost!r}"
        )
    nodes = record["lost_nodes"]
    if (
        not isinstance(nodes, (list, tuple))
        or len(nodes) != len(lost)
        or not all(_is_int(n) and n >= 0 for n in nodes)
    ):
        raise ValueError(
            f"membership record: 'lost_nodes' must be {len(lost)} node id(s), one per lost "
            f"worker, got {nodes!r}"
        )
    hosts = record["lost_hosts"]
    if (
        not isinstance(hosts, (list, tuple))
        or len(hosts) != len(lost)
        or not all(h is None or isinstance(h, str) for h in hosts)
    ):
        raise ValueError(
            f"membership record: 'lost_hosts' must be {len(lost)} host name(s) or null, one per "
            f"lost worker, got {hosts!r}"
        )
    heal_s = record["heal_s"]
    if (
        isinstance(heal_s, (bool, np.bool_))
        or not isinstance(heal_s, (int, float, np.integer, np.floating))
        or not math.isfinite(heal_s)
        or heal_s < 0
    ):
        raise ValueError(f"membership record: 'heal_s' must be seconds >= 0, got {heal_s!r}")
    gone = absent_after(earlier)
    again = sorted(gone & {int(w) for w in lost})
    if again:
        raise ValueError(
            f"membership record: 'lost' names worker(s) {again} lost before and not re-admitted"
        )
    back = sorted({int(w) for w in readmitted} - gone)
    if back:
        raise ValueError(
            f"membership record: {READMITTED_KEY!r} names worker(s) {back} not lost (never lost, "
            "or re-admitted since)"
        )
    if earlier and step < earlier[-1]["step"]:
        raise ValueError(
            f"membership record: 'step' {step} is before the previous change's "
            f"{earlier[-1]['step']} (records go in order)"
        )
    after = (earlier[-1]["world_size"] if earlier else world_size) - len(lost) + len(readmitted)
    size = record["world_size"]
    if not _is_int(size) or size != after:
        what = "re-admitted" if readmitted else "left"
        raise ValueError(
            f"membership record: 'world_size' must be the workers {what} after the change, "
            f"{after}, got {size!r}"
        )
    checked: dict[str, Any] = {
        "step": int(step),
        "lost": [int(w) for w in lost],
        "lost_nodes": [int(n) for n in nodes],
        "lost_hosts": [None if h is None else str(h) for h in hosts],
        "world_size": int(size),
        "heal_s": float(heal_s),
    }
    if readmitted:  # a loss keeps the record it always had (an empty list says nothing)
        checked[READMITTED_KEY] = [int(w) for w in readmitted]
    if STALLED_KEY in record or SILENT_KEY in record:
        checked.update(_checked_stall(record, checked["lost"]))
    return checked


def _checked_stall(record: Mapping[str, Any], lost: list[int]) -> dict[str, Any]:
    """An eviction's keys, checked: ``stalled`` a non-empty list of distinct lost ids,
    ``silent_s`` seconds >= 0."""
    stalled, silent = record.get(STALLED_KEY), record.get(SILENT_KEY)
    if (
        not isinstance(stalled, (list, tuple))
        or not stalled
        or not all(_is_int(w) and w in lost for w in stalled)
        or len(set(stalled)) != len(stalled)
    ):
        raise ValueError(
            f"membership record: {STALLED_KEY!r} must be a non-empty list of distinct ids among "
            f"'lost' {lost}, got {stalled!r}"
        )
    if (
        isinstance(silent, (bool, np.bool_))
        or not isinstance(silent, (int, float, np.integer, np.floating))
        or not math.isfinite(silent)
        or silent < 0
    ):
        raise ValueError(f"membership record: {SILENT_KEY!r} must be seconds >= 0, got {silent!r}")
    return {STALLED_KEY: [int(w) for w in stalled], SILENT_KEY: float(silent)}


def _stalled_text(change: Mapping[str, Any], worker: int) -> str:
    """', stalled: silent 2.1 s' for a worker evicted for silence, else ''."""
    if worker not in change.get(STALLED_KEY, ()):
        return ""
    return f", stalled: silent {_seconds(float(change[SILENT_KEY]))} s"


def _worker_list(workers: Any, world_size: int) -> bool:
    """Whether ``workers`` is a list of distinct worker ids in [0, world_size)."""
    return (
        isinstance(workers, (list, tuple))
        and all(_is_int(w) and 0 <= w < world_size for w in workers)
        and len(set(workers)) == len(workers)
    )


def readmitted_of(change: Mapping[str, Any]) -> list[int]:
    """The original ids a change re-admitted ([] for a loss, and for every older record)."""
    return [int(w) for w in change.get(READMITTED_KEY) or ()]


def absent_after(membership: Sequence[Mapping[str, Any]]) -> set[int]:
    """The original ids of the workers out of the run after all of ``membership``: lost and not
    re-admitted since."""
    gone: set[int] = set()
    for change in membership:
        gone |= {int(w) for w in change["lost"]}
        gone -= set(readmitted_of(change))
    return gone


def parse_membership(text: Any) -> list[dict[str, Any]]:
    """The records of a ``membership`` attribute's JSON text ([] for None: an older file).

    Raises:
        ValueError: text that is not a JSON list of objects with RECORD_KEYS.
    """
    if text is None:
        return []
    try:
        records = json.loads(text)
    except (TypeError, ValueError) as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if not isinstance(records, list) or not all(
        isinstance(r, dict) and set(RECORD_KEYS) <= set(r) for r in records
    ):
        raise ValueError(f"not a JSON list of records with the keys {list(RECORD_KEYS)}")
    for r in records:
        readmitted = r.get(READMITTED_KEY, [])
        if not isinstance(readmitted, list) or not all(_is_int(w) for w in readmitted):
            raise ValueError(
                f"a record whose {READMITTED_KEY!r} is not a list of worker ids: {readmitted!r}"
            )
    return records


def lost_at(membership: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Each lost worker's original id -> the step from which it took no part (its latest loss,
    for a worker lost again after it was re-admitted)."""
    return {int(w): int(change["step"]) for change in membership for w in change["lost"]}


def readmitted_at(membership: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """Each re-admitted worker's original id -> the step from which it took part again (its
    latest re-admission); {} for records without re-admissions."""
    return {int(w): int(change["step"]) for change in membership for w in readmitted_of(change)}


def absences(membership: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, int | None]]:
    """Every time a worker was out of the run: (original id, the step it was lost at, the step
    it was re-admitted at, or None: not re-admitted), in the records' order of the losses."""
    spans: list[tuple[int, int, int | None]] = []
    open_: dict[int, int] = {}  # worker -> index in spans of its loss not re-admitted yet
    for change in membership:
        for w in change["lost"]:
            open_[int(w)] = len(spans)
            spans.append((int(w), int(change["step"]), None))
        for w in readmitted_of(change):
            if w in open_:
                at = open_.pop(w)
                spans[at] = (w, spans[at][1], int(change["step"]))
    return spans


def finished_workers(world_size: int, membership: Sequence[Mapping[str, Any]]) -> list[int]:
    """The original ids of the workers in the run at its end: every worker no change lost, and
    those re-admitted after their latest loss (all ``world_size`` without changes)."""
    gone = absent_after(membership)
    return [w for w in range(world_size) if w not in gone]


def present(
    step: np.ndarray, world_size: int, membership: Sequence[Mapping[str, Any]]
) -> np.ndarray:
    """[rows, world_size] bool: whether worker w took part at each row's ``step``: false from the
    step of the change that lost it on, until the step it was re-admitted at (excluded), where
    its columns are NaN by design."""
    steps = np.asarray(step, dtype=np.int64).reshape(-1)
    mask = np.ones((len(steps), world_size), dtype=bool)
    for worker, lost, back in absences(membership):
        if worker < world_size:
            out = steps >= lost
            if back is not None:
                out &= steps < back
            mask[out, worker] = False
    return mask


def _node_host(node: Any, host: Any) -> str:
    return f"node {node}" + ("" if host is None else f", host {host}")


def change_text(change: Mapping[str, Any]) -> str:
    """One change in words: 'step 1230: lost rank 7 (node 1, host node2); 15 workers after;
    healed in 0.41 s', or for a re-admission 'step 300: re-admitted rank 7; 16 workers after; in
    0.20 s'."""
    after = int(change["world_size"])
    workers = f"{after} worker{'s' if after != 1 else ''}"
    readmitted = readmitted_of(change)
    if readmitted:
        return (
            f"step {change['step']}: re-admitted {', '.join(f'rank {w}' for w in readmitted)}; "
            f"{workers} after; in {float(change['heal_s']):.2f} s"
        )
    ranks = [
        f"rank {w} ({_node_host(n, h)}{_stalled_text(change, w)})"
        for w, n, h in zip(change["lost"], change["lost_nodes"], change["lost_hosts"], strict=False)
    ]
    return (
        f"step {change['step']}: lost {', '.join(ranks)}; {workers} after; "
        f"healed in {float(change['heal_s']):.3g} s"
    )


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 0.1 else f"{value:.1g}"


def summary_text(world_size: int, membership: Sequence[Mapping[str, Any]]) -> str:
    """The end summary's words: '15 of 16 workers finished; rank 7 (node2) lost at step 1230,
    healed in 0.4 s' ('; ' between changes; a re-admission: 'rank 7 re-admitted at step 300');
    '' without changes."""
    if not membership:
        return ""
    parts = [f"{len(finished_workers(world_size, membership))} of {world_size} workers finished"]
    for change in membership:
        readmitted = readmitted_of(change)
        if readmitted:
            back = " and ".join(f"rank {w}" for w in readmitted)
            parts.append(f"{back} re-admitted at step {change['step']}")
            continue
        ranks = [
            f"rank {w} ({h if h is not None else f'node {n}'}{_stalled_text(change, w)})"
            for w, n, h in zip(
                change["lost"], change["lost_nodes"], change["lost_hosts"], strict=False
            )
        ]
        parts.append(
            f"{' and '.join(ranks)} lost at step {change['step']}, "
            f"healed in {_seconds(float(change['heal_s']))} s"
        )
    return "; ".join(parts)
