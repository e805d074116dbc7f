"""The hang watchdog: each rank's progress on the job's c10d store, and a verdict naming hung ranks.

When one rank stops arriving (stuck in I/O, deadlocked, SIGSTOPped), DDP's own collective blocks every
other rank's training thread in C++ until the process-group timeout. A daemon thread per rank therefore
keeps a side channel that needs no collective: about once a second it writes this rank's progress and a
heartbeat to the store that the job rendezvoused on, and once this rank's own progress has stood still
for ``hang_timeout_s`` it reads every rank's entry and names the ranks that are behind the others or
whose heartbeat stopped. The verdict is a pure function of the store's entries (:func:`hang_verdict`),
so every rank that reads them reaches the same one. No host clock is compared across ranks: a
heartbeat is the seconds that rank's own watchdog has been running, and a stopped one falls behind the
others' by the time it has been stopped.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = [
    "HANG_EXIT_CODE",
    "HangReport",
    "HangWatchdog",
    "RankProgress",
    "confirm_after_s",
    "hang_verdict",
    "heartbeat_interval_s",
    "job_store",
    "stale_after_s",
]

log = logging.getLogger(__name__)

#: exit status of a rank that aborts on a hang (EX_TEMPFAIL: "try again"; any non-zero status makes
#: torchrun / a scheduler restart the job)
HANG_EXIT_CODE = 75
#: most often a rank writes its entry; shorter for short timeouts so that a verdict sees fresh entries
MAX_HEARTBEAT_INTERVAL_S = 1.0
#: longest a single store call of the watchdog may block (a store host that is itself stopped must
#: not stop the watchdog)
MAX_STORE_TIMEOUT_S = 10.0


def heartbeat_interval_s(hang_timeout_s: float) -> float:
    """Seconds between two writes of a rank's entry: 1 s, or a sixth of a short ``hang_timeout_s``."""
    return min(MAX_HEARTBEAT_INTERVAL_S, hang_timeout_s / 6)


def stale_after_s(hang_timeout_s: float) -> float:
    """A heartbeat this many seconds behind the freshest one has stopped: half the hang timeout, and
    at least three heartbeat intervals (a live rank's entry is at most one interval old)."""
    return max(hang_timeout_s / 2, 3 * heartbeat_interval_s(hang_timeout_s))


def confirm_after_s(hang_timeout_s: float) -> float:
    """How long a trailing heartbeat must stay unchanged before it counts as stopped: a tenth of the
    hang timeout, and at least three heartbeat intervals."""
    return max(hang_timeout_s / 10, 3 * heartbeat_interval_s(hang_timeout_s))


def job_store() -> dist.Store | None:
    """The c10d store the default process group rendezvoused on, or ``None`` without one.

    torch has no public accessor for it; this is the one place that calls the private one
    (``tests/unit/test_watchdog.py`` fails when torch moves it). Under torchrun the store lives in the
    launcher's agent, so it stays reachable when any rank stops.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        log.warning("pace_strategy: this torch has no default-store accessor; the hang watchdog is off")
        return None
    try:
        store: dist.Store = getter()
    except (RuntimeError, ValueError):
        return None
    return store


@dataclass(frozen=True)
class RankProgress:
    """One rank's entry on the store.

    ``progress`` is ``3 * steps ended + phase`` (phase 0 between steps, 1 step begun, 2 arrived at the
    sync point; see ``Pacer.progress``), ``step`` the label of the last step begun, ``alive_s`` the
    seconds this rank's watchdog has been running when it wrote the entry (its heartbeat).
    """

    progress: int
    step: int
    alive_s: float

    def to_json(self) -> str:
        return json.dumps({"p": self.progress, "s": self.step, "t": round(self.alive_s, 3)})

    @classmethod
    def from_json(cls, text: bytes | str) -> RankProgress | None:
        """The entry, or ``None`` for one that is not ours (never raises: the watchdog must go on)."""
        try:
            obj = json.loads(text)
            return cls(progress=int(obj["p"]), step=int(obj["s"]), alive_s=float(obj["t"]))
        except (ValueError, TypeError, KeyError):
            return None

    @property
    def in_step(self) -> bool:
        """Whether the rank is inside a step (begun, not ended)."""
        return self.progress % 3 != 0

    @property
    def at_sync(self) -> bool:
        """Whether the rank has arrived at its step's sync point (waiting for its peers there)."""
        return self.progress % 3 == 2


@dataclass(frozen=True)
class HangReport:
    """Which ranks are hung, as every rank that read the store's entries concludes.

    ``behind``: ranks whose progress is behind the furthest live rank's; ``stale``: ranks whose
    heartbeat stopped (SIGSTOP, a process frozen holding the GIL) or that never wrote an entry;
    ``ranks``: both. ``unconfirmed``: ranks whose heartbeat trails but whose entry has not yet been
    seen unchanged over a confirmation interval (a rank starved of CPU for a moment); while there are
    any, the verdict waits. ``step`` is the label of the step the furthest rank is at, ``waited_s``
    how long this rank's own progress had stood still when it read the store.
    """

    ranks: tuple[int, ...]
    behind: tuple[int, ...]
    stale: tuple[int, ...]
    step: int
    waited_s: float
    hosts: tuple[str, ...] = ()  #: the host of each rank in ``ranks``
    unconfirmed: tuple[int, ...] = ()

    def sentences(self) -> list[str]:
        """One per named rank: ``rank k (host h) has not reached step s for 20 s (why)``."""
        lines = []
        for k, host in zip(self.ranks, self.hosts or ("?",) * len(self.ranks), strict=True):
            why = (
                "its heartbeat stopped: the process is frozen or gone"
                if k in self.stale
                else "its heartbeat is live: the process runs but has not got there"
            )
            where = f"step {self.step}" if self.step >= 0 else "its first step"
            lines.append(f"rank {k} (host {host}) has not reached {where} for {self.waited_s:.0f} s ({why})")
        return lines

    def messages(self, rank: int, world_size: int) -> list[str]:
        """The log lines: ``[rank r/N] pace_strategy: `` and a sentence."""
        return [f"[rank {rank}/{world_size}] pace_strategy: {s}" for s in self.sentences()]


def hang_verdict(
    entries: Mapping[int, RankProgress | None],
    world_size: int,
    stale_s: float,
    waited_s: float,
    earlier: Mapping[int, RankProgress | None] | None = None,
) -> HangReport:
    """Name the hung ranks from the store's entries (pure: the same entries give the same verdict).

    A rank is stale when its heartbeat trails the freshest by more than ``stale_s`` seconds or it
    wrote no entry, and its entry is the same in ``earlier`` (the entries read a confirmation interval
    before; without them such ranks are ``unconfirmed``); behind when its progress is less than the
    furthest live rank's. Only live ranks
    set the front: a rank stopped just after its part of a collective may have written a step end
    that its peers, still waiting for its last bytes, never reach. For the same reason, once a
    rank's heartbeat stopped, a live rank waiting at its sync point is not named as behind: a
    collective may complete on some ranks before others (a ring all-reduce delivers the stopped
    rank's last bytes to one peer and not yet to the next), so one live peer moves on to the next
    step while another still waits for the frozen rank. Ranks that all stand at the same place
    with live heartbeats (a pause every rank takes, or a collective stuck in the network) name
    nobody.
    """
    present = {r: e for r, e in entries.items() if e is not None and 0 <= r < world_size}
    missing = tuple(r for r in range(world_size) if r not in present)
    if not present:
        return HangReport(ranks=missing, behind=(), stale=missing, step=-1, waited_s=waited_s)
    freshest = max(e.alive_s for e in present.values())
    trailing = sorted({r for r, e in present.items() if freshest - e.alive_s > stale_s} | set(missing))
    live = {r: e for r, e in present.items() if r not in trailing} or present
    front = max(e.progress for e in live.values())
    step = max(e.step for e in live.values() if e.progress == front)
    frozen = {r for r in trailing if earlier is not None and r in earlier and earlier[r] == entries.get(r)}
    unconfirmed = tuple(r for r in trailing if r not in frozen)
    if unconfirmed:
        return HangReport(
            ranks=(), behind=(), stale=(), step=step, waited_s=waited_s, unconfirmed=unconfirmed
        )
    stale = tuple(trailing)
    behind = tuple(
        r
        for r, e in sorted(present.items())
        if e.progress < front and not (stale and r not in stale and e.at_sync)
    )
    ranks = tuple(sorted(set(behind) | set(stale)))
    return HangReport(ranks=ranks, behind=behind, stale=stale, step=step, waited_s=waited_s)


class HangWatchdog:
    """The daemon thread of one rank: publishes its progress, detects a stall, names the hung ranks.

    Args:
        store: the job's c10d store (:func:`job_store`); the watchdog talks to it through its own
            clone (its own connection and timeout) under ``namespace``.
        namespace: key prefix, identical on every rank of the job and new for each session (so that a
            restarted job, or a second session, never reads stale entries).
        rank, world_size: this rank and the job's size.
        hosts: every rank's host (the session's topology), for the log lines and the record.
        hang_timeout_s: seconds this rank's progress may stand still before it reads the store.
        progress: returns this rank's ``(progress, step label)`` (``Pacer.progress``, ``progress_step``).
        on_hang: called on the watchdog thread with the report once ranks are named (once per stall).
        clock: monotonic seconds (a fake one in unit tests).
    """

    def __init__(
        self,
        store: dist.Store,
        namespace: str,
        *,
        rank: int,
        world_size: int,
        hosts: Sequence[str],
        hang_timeout_s: float,
        progress: Callable[[], tuple[int, int]],
        on_hang: Callable[[HangReport], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0 for a watchdog, got {hang_timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.hosts = list(hosts)
        self.hang_timeout_s = hang_timeout_s
        self.interval_s = heartbeat_interval_s(hang_timeout_s)
        self.stale_s = stale_after_s(hang_timeout_s)
        self.confirm_s = confirm_after_s(hang_timeout_s)
        self._progress = progress
        self._on_hang = on_hang
        self._clock = clock
        # its own connection: a store client is not safe to share between threads, and its timeout
        # must not change the job's (``clone`` is in every c10d store, but not in torch's stubs)
        client = store.clone()  # type: ignore[attr-defined]
        client.set_timeout(timedelta(seconds=min(MAX_STORE_TIMEOUT_S, max(self.interval_s, 1.0))))
        self._store = dist.PrefixStore(namespace, client)
        self._keys = [f"rank{r}" for r in range(world_size)]
        self._started = clock()
        self._last: int | None = None
        self._still_since = self._started
        self._next_check = self._started + hang_timeout_s
        self._store_failed = False
        self._warned: int | None = None
        self._earlier: dict[int, RankProgress | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports: list[HangReport] = []  #: every verdict that named ranks, oldest first
        self.publish()  # an entry exists from the start: a rank that never writes one is named too

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"pace-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (it may be inside one store call: it is a daemon, so it is not waited for long)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval_s + 1.0)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # the watchdog must never take training down
                log.exception("pace_strategy: the hang watchdog failed; it is off for the rest of the run")
                return

    def publish(self) -> None:
        progress, step = self._progress()
        entry = RankProgress(progress=progress, step=step, alive_s=self._clock() - self._started)
        self._call(lambda: self._store.set(self._keys[self.rank], entry.to_json()))

    def tick(self) -> HangReport | None:
        """One round: note progress, write the entry, and read the store once stalled. Returns the
        report when this round named ranks."""
        now = self._clock()
        progress, _ = self._progress()
        if progress != self._last:
            self._last, self._still_since = progress, now
            self._next_check = now + self.hang_timeout_s
            self._earlier = None
        self.publish()
        if now < self._next_check or self._stop.is_set():
            return None
        self._next_check = now + self.hang_timeout_s  # at most one verdict per hang_timeout_s
        entries = self.read()
        if entries is None:
            return None
        earlier, self._earlier = self._earlier, None
        report = hang_verdict(entries, self.world_size, self.stale_s, now - self._still_since, earlier)
        if report.unconfirmed:
            # a trailing heartbeat: read again after the confirmation interval, and name it only if
            # its entry has not changed meanwhile (a live rank starved of CPU writes again)
            self._earlier = entries
            self._next_check = now + self.confirm_s
            return None
        if not report.ranks:
            if progress % 3 and self._warned != progress:
                self._warned = progress  # once per stall
                log.warning(
                    "[rank %d/%d] pace_strategy: step %d has not completed for %.0f s, but every rank "
                    "reports the same progress and a live heartbeat (a pause on every rank, or a "
                    "collective stuck in the network)",
                    self.rank,
                    self.world_size,
                    report.step,
                    report.waited_s,
                )
            return None
        report = HangReport(
            ranks=report.ranks,
            behind=report.behind,
            stale=report.stale,
            step=report.step,
            waited_s=report.waited_s,
            hosts=tuple(self._host(r) for r in report.ranks),
        )
        self._next_check = float("inf")  # reported: once per stall (progress re-arms it)
        self.reports.append(report)
        self._call(lambda: self._store.set(f"verdict{self.rank}", str(report.step)))
        for message in report.messages(self.rank, self.world_size):
            log.error(message)
        self._on_hang(report)
        return report

    def wait_for_verdicts(self, report: HangReport) -> bool:
        """Before this rank aborts: wait until every rank that ``report`` does not name has reached its
        verdict too (each announces it on the store), at most ``hang_timeout_s`` plus two heartbeats.

        A rank that left first would close its connections, and a peer still waiting out its own
        timeout would then fail in the collective with a connection error instead of naming the
        hung rank (and rank 0 could not record it). Returns whether they all had."""
        others = [f"verdict{r}" for r in range(self.world_size) if r not in report.ranks and r != self.rank]
        deadline = self._clock() + self.hang_timeout_s + 2 * self.interval_s
        while others and self._clock() < deadline:
            if self._call(lambda: self._store.check(others)):
                return True
            time.sleep(min(0.1, self.interval_s))
        return not others

    def publish_stacks(self, text: str) -> None:
        """Put this rank's Python stacks on the store (the hang evidence; rank 0 collects them)."""
        self._call(lambda: self._store.set(f"stacks{self.rank}", text))

    def collect_stacks(self, ranks: Sequence[int], timeout_s: float) -> dict[int, str]:
        """The stacks ``ranks`` have published, waiting at most ``timeout_s`` for them all (a rank
        reaches its verdict within a heartbeat or two of the others; a frozen one never does)."""
        keys = {r: f"stacks{r}" for r in ranks}
        found: dict[int, str] = {}
        deadline = self._clock() + timeout_s
        while True:
            for r, key in keys.items():
                if r not in found:
                    value = self._call(functools.partial(self._stored, key))
                    if value is not None:
                        found[r] = value.decode(errors="replace")
            if len(found) == len(keys) or self._clock() >= deadline:
                return found
            time.sleep(min(0.1, self.interval_s))

    def announce_evidence(self) -> None:
        """Rank 0: the hang evidence is written (or given up on)."""
        self._call(lambda: self._store.set("evidence", "1"))

    def wait_for_evidence(self, timeout_s: float) -> bool:
        """Before this rank aborts: wait, at most ``timeout_s``, until rank 0 announces the evidence. A
        rank that left first would break the collective rank 0's training thread is blocked in, and
        that thread would end the process before the evidence is written. Returns whether it had."""
        deadline = self._clock() + timeout_s
        while self._clock() < deadline:
            if self._call(lambda: self._store.check(["evidence"])):
                return True
            time.sleep(min(0.1, self.interval_s))
        return False

    def _stored(self, key: str) -> bytes | None:
        return bytes(self._store.get(key)) if self._store.check([key]) else None

    def read(self) -> dict[int, RankProgress | None] | None:
        """Every rank's entry (``None`` for one not written); ``None`` when the store is unreachable."""

        def get() -> dict[int, RankProgress | None]:
            if self._store.check(self._keys):
                values = self._store.multi_get(self._keys)
                return {r: RankProgress.from_json(v) for r, v in enumerate(values)}
            return {
                r: RankProgress.from_json(self._store.get(k)) if self._store.check([k]) else None
                for r, k in enumerate(self._keys)
            }

        return self._call(get)

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else "?"

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError) as error:  # DistStoreError is a RuntimeError
            if not self._store_failed:
                self._store_failed = True
                log.warning(
                    "[rank %d/%d] pace_strategy: the hang watchdog cannot reach the job's store (%s); "
                    "if the store lives in rank 0's process (not under torchrun), rank 0 is probably "
                    "stopped",
                    self.rank,
                    self.world_size,
                    error,
                )
            return None
