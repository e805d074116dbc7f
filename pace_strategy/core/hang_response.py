"""What a rank does once its hang watchdog (:mod:`pace_strategy.core.watchdog`) names hung ranks.

Rank 0 records the hang and its evidence (``RUN_DIR/hang/``: every live rank's stacks, where each rank
stood, the Flight Recorder). With ``hang.action="abort"`` rank 0 closes the record (status ``hung``)
first, the ranks on this host whose heartbeat stopped are ended (SIGKILL: a stopped process holds its
launcher's pipes), every rank stays until rank 0 has the evidence (a rank that left first would break
rank 0's collective) and the process exits with :data:`~pace_strategy.core.watchdog.HANG_EXIT_CODE`,
since a thread cannot raise into a training thread blocked in a C++ collective.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pace_strategy.core.config import HangConfig
from pace_strategy.core.errors import PaceHangError
from pace_strategy.core.evidence import (
    EVIDENCE_DIR,
    flight_recorder_dump,
    kill_frozen_local_ranks,
    python_stacks,
    rank_marks,
    write_evidence,
)
from pace_strategy.core.watchdog import HANG_EXIT_CODE, HangReport, HangWatchdog, job_store

__all__ = ["HangResponse", "hold_uncaught_errors", "start_watchdog"]

log = logging.getLogger(__name__)

#: numbers this process's sessions in order: every rank builds the same sessions, so the n-th is the
#: n-th everywhere (the hang watchdog's store namespace)
_SESSION_NUMBERS = itertools.count()


def start_watchdog(
    config: HangConfig,
    *,
    rank: int,
    world_size: int,
    topology: Sequence[Mapping[str, Any]],
    restart_count: int,
    record_path: Path | None,
    line_of: Callable[..., dict[str, Any]],
    report: Callable[[Mapping[str, Any]], None],
    close_hung: Callable[[PaceHangError], bool],
    record_note: Callable[[], str],
    progress: Callable[[], tuple[int, int]],
) -> HangWatchdog | None:
    """A session's hang watchdog on the job's store, with its response (none for one rank,
    ``hang.timeout_s=0`` or no store). ``line_of(report, topology=, action=)`` is the run record's
    hang line; the other arguments are :class:`HangResponse`'s and :class:`HangWatchdog`'s.

    Its keys live under a namespace that every rank computes alike and that no earlier session or
    attempt of the job used: the restart count and this process's session number."""
    store = job_store() if world_size > 1 and config.timeout_s > 0 else None
    if store is None:
        return None
    response = HangResponse(
        config,
        rank=rank,
        world_size=world_size,
        topology=topology,
        evidence_dir=None if record_path is None else record_path.parent / EVIDENCE_DIR,
        line_of=functools.partial(line_of, topology=topology, action=config.action),
        report=report,
        close_hung=close_hung,
        record_note=record_note,
    )
    namespace = f"pace_strategy/watchdog/{restart_count}/{next(_SESSION_NUMBERS)}"
    return response.start(store, namespace, progress)


def hold_uncaught_errors(seconds: float) -> None:
    """The watchdog is ending the process with the hang's exit code: an exception that reaches the top
    of the training thread meanwhile (a peer that already left closed the connection of the collective
    it was blocked in) waits up to ``seconds`` for that exit instead of ending the process first with
    its own code, which would tell the launcher a rank failed rather than hung. Seen once in a
    3-process test: rank 0 aborted, and rank 2's DDP all-reduce failed before its watchdog's exit."""
    previous = sys.excepthook

    def hold(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        log.error("pace_strategy: the training thread failed while the hang abort runs: %s", error)
        time.sleep(seconds)  # the watchdog's os._exit ends the process first
        previous(kind, error, tb)

    sys.excepthook = hold


class HangResponse:
    """One rank's response to its watchdog's verdict (the watchdog's ``on_hang``; its thread).

    Args:
        config: ``hang.timeout_s`` and ``hang.action``.
        rank, world_size: this rank's place.
        topology: every rank's placement (host, pid, GPU) to name the hung ranks by.
        evidence_dir: rank 0 with a run record: where the evidence goes (``None``: no evidence written).
        line_of: the run record's ``hang`` line of a verdict.
        report: tells every telemetry sink (the run record's hang line, the endpoint's hang count).
        close_hung: closes this rank's session with status ``hung``; returns whether it was open.
        record_note: the text that says where the run record is kept (empty when none).
    """

    def __init__(
        self,
        config: HangConfig,
        *,
        rank: int,
        world_size: int,
        topology: Sequence[Mapping[str, Any]],
        evidence_dir: Path | None,
        line_of: Callable[[HangReport], dict[str, Any]],
        report: Callable[[Mapping[str, Any]], None],
        close_hung: Callable[[PaceHangError], bool],
        record_note: Callable[[], str],
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.topology = topology
        self.evidence_dir = evidence_dir
        self._line_of = line_of
        self._report = report
        self._close_hung = close_hung
        self._record_note = record_note
        self.watchdog: HangWatchdog | None = None  #: once :meth:`start` started it

    def start(self, store: Any, namespace: str, progress: Callable[[], tuple[int, int]]) -> HangWatchdog:
        """Start this rank's watchdog on the job's ``store``, under a ``namespace`` that every rank
        computes alike and that no earlier session or attempt used, with this response as its verdict's."""
        self.watchdog = HangWatchdog(
            store,
            namespace,
            rank=self.rank,
            world_size=self.world_size,
            hosts=[str(p.get("host", "?")) for p in self.topology],
            hang_timeout_s=self.config.timeout_s,
            progress=progress,
            on_hang=self,
        )
        self.watchdog.start()
        return self.watchdog

    @property
    def evidence_wait_s(self) -> float:
        """How long rank 0 waits for the live ranks' stacks (they publish them at their verdict, within
        a heartbeat or two of each other)."""
        return min(10.0, self.config.timeout_s)

    def __call__(self, report: HangReport) -> None:
        line = self._line_of(report)
        self._report(line)
        abort = self.config.action == "abort"
        if abort:
            hold_uncaught_errors(self.evidence_wait_s + 60.0)
        try:
            if abort:  # the end line first: nothing after may be in time
                self._close_hung(self.error(report, line))
            evidence = None if self.watchdog is None else self._evidence(self.watchdog, report, line)
            if evidence is not None:
                log.error(
                    "[rank %d/%d] pace_strategy: hang evidence in %s", self.rank, self.world_size, evidence
                )
            if abort:
                self._leave_together(report)
        finally:
            if abort:
                logging.shutdown()  # flush every handler: nothing runs after os._exit
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(HANG_EXIT_CODE)

    def _leave_together(self, report: HangReport) -> None:
        """End this host's frozen ranks, wait for every rank's verdict (and rank 0's evidence), say so."""
        host = str(self.topology[self.rank].get("host")) if self.rank < len(self.topology) else ""
        killed = kill_frozen_local_ranks(report.stale, self.topology, host, self.rank)
        if killed:
            log.error(
                "[rank %d/%d] pace_strategy: ended frozen rank(s) %s on this host (SIGKILL)",
                self.rank,
                self.world_size,
                ", ".join(map(str, killed)),
            )
        if self.watchdog is not None:
            self.watchdog.wait_for_verdicts(report)  # leave together: see HangWatchdog.wait_for_verdicts
            if self.rank != 0 and 0 not in report.ranks:
                self.watchdog.wait_for_evidence(self.evidence_wait_s + 2 * self.watchdog.interval_s)
        log.error(
            "[rank %d/%d] pace_strategy: aborting the process (exit code %d) so that the launcher "
            "can restart the job%s",
            self.rank,
            self.world_size,
            HANG_EXIT_CODE,
            self._record_note(),
        )

    def _evidence(self, watchdog: HangWatchdog, report: HangReport, line: Mapping[str, Any]) -> Path | None:
        """Every rank publishes its Python stacks; rank 0 collects the live ranks' (a bounded wait),
        writes the evidence directory (:func:`~pace_strategy.core.evidence.write_evidence`) and
        announces it on the store. Returns the directory on rank 0. Best effort: a failure is logged,
        never raised."""
        try:
            stacks = python_stacks()
            watchdog.publish_stacks(stacks)
            if self.evidence_dir is None:
                return None
            live = [r for r in range(self.world_size) if r not in report.stale and r != self.rank]
            collected = watchdog.collect_stacks(live, timeout_s=self.evidence_wait_s)
            collected[self.rank] = stacks
            entries = watchdog.read() or {}
            marks = {
                r: None if e is None else rank_marks(e.progress, e.step, e.alive_s)
                for r, e in entries.items()
            }
            return write_evidence(self.evidence_dir, line, marks, collected, flight_recorder_dump())
        except Exception:
            log.exception("pace_strategy: could not write the hang evidence")
            return None
        finally:
            if self.evidence_dir is not None:
                watchdog.announce_evidence()  # written or not: nobody waits longer for it

    def error(self, report: HangReport, line: Mapping[str, Any]) -> PaceHangError:
        """The typed error of an abort: the verdict, and each hung rank's host, pid and GPU."""
        who = ", ".join(
            f"rank {r} (host {h}, pid {p}{f', GPU {g}' if g else ''})"
            for r, h, p, g in zip(report.ranks, line["hosts"], line["pids"], line["gpus"], strict=True)
        )
        text = "; ".join(report.sentences())
        return PaceHangError(
            self.rank,
            self.world_size,
            f"{text}; hung: {who}; aborted (hang.action='abort')",
            ranks=tuple(report.ranks),
            hosts=tuple(line["hosts"]),
            pids=tuple(line["pids"]),
        )
