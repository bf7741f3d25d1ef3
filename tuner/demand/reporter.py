"""Demand: the problems this process ran without a tuned config, reported to the config
service in the background, so that ``tuner worker`` tunes what jobs actually run (issue 18,
item 1).

The config resolver (``tuner.lookup.resolver``) notes every problem it answers with the template's
default or a nearest shape, keyed by (template, template version, device key, problem): once
per plan that ``tuner.attention`` or ``tuner.decode`` makes, which for an untuned problem is
again every few seconds while the job runs it (``UNTUNED_TTL_S``), so the counts grow with
how long a job runs it. Nothing is noted without ``TUNER_URL``, or with ``TUNER_DEMAND=off``.

Noting costs a dict update under a lock: it never waits on the network and never raises. A
daemon thread sends what was noted every ``TUNER_DEMAND_INTERVAL`` seconds (and once at exit)
as ``POST /v1/demand``, at most ``BATCH_ITEMS`` problems per request. Memory is bounded: at
most ``MAX_PENDING`` distinct problems are held between reports; reports of more are dropped
and counted (``dropped``). A report the service could not take (down, overloaded, rate
limited) is held for the next attempt, within the same bound; one it refused as invalid is
dropped (``refused``) and logged.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Iterable

from templates.base import Problem
from tuner.errors import ServiceError

__all__ = ["BATCH_ITEMS", "MAX_PENDING", "UNTUNED", "DemandReporter"]

log = logging.getLogger("tuner.demand.reporter")

# Matches that mean "nothing measured for this problem's bucket on this device".
UNTUNED = frozenset({"default", "nearest"})
# Distinct problems held between two reports. A job runs tens of distinct shapes; a decode
# loop whose KV length grows makes one per step, many of them in few buckets, and the service
# counts per bucket anyway.
MAX_PENDING = 1024
BATCH_ITEMS = 250  # per request: the service takes up to api.routes.demand.MAX_ITEMS

DemandKey = tuple[str, str, str, Problem]  # template, template version, device key, problem


class DemandReporter:
    """Counts untuned problems and reports them to the service at ``url`` in the background."""

    def __init__(self, url: str, *, interval_s: float, timeout_s: float,
                 max_pending: int = MAX_PENDING, batch_items: int = BATCH_ITEMS) -> None:
        if interval_s <= 0 or timeout_s <= 0 or max_pending < 1 or batch_items < 1:
            raise ValueError(f"interval_s and timeout_s must be > 0, max_pending and "
                             f"batch_items >= 1, but got {interval_s}, {timeout_s}, "
                             f"{max_pending}, {batch_items}")
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.batch_items = batch_items
        self.sent = 0  # reports the service counted
        self.dropped = 0  # reports not held: MAX_PENDING distinct problems were waiting
        self.refused = 0  # reports the service refused as invalid
        self._pending: dict[DemandKey, int] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one report at a time (the thread, or at exit)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False  # the last request failed: say so once, not every interval

    # -- the caller's side: never blocks on the network, never raises -----------------------
    def note(self, template: str, version: str, device_key: str, problem: Problem) -> None:
        key = (template, version, device_key, problem)
        with self._lock:
            held = self._pending.get(key)
            if held is not None:
                self._pending[key] = held + 1
            elif len(self._pending) < self.max_pending:
                self._pending[key] = 1
            else:
                self.dropped += 1
                return
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="tuner-demand",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.close)

    @property
    def pending(self) -> int:
        """Reports noted and not yet sent."""
        with self._lock:
            return sum(self._pending.values())

    # -- the reporter's side ------------------------------------------------------------------
    def flush(self) -> None:
        """Send what is held now; what the service could not take is held again."""
        with self._send_lock:
            with self._lock:
                held, self._pending = self._pending, {}
            items = list(held.items())
            for start in range(0, len(items), self.batch_items):
                batch = items[start:start + self.batch_items]
                if not self._send(batch):
                    self._hold_again(items[start:])
                    return

    def close(self) -> None:
        """Stop the thread and send what is left (at exit: at most one request's timeout)."""
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.timeout_s)
        self.flush()

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # a bug here must not end the reporting, nor reach the job
                log.exception("demand report to %s failed", self.url)

    def _send(self, batch: list[tuple[DemandKey, int]]) -> bool:
        """POST one batch; False when it should be sent again later."""
        # lazy: httpx +0.13 s (2-core CPU); `import tuner.attention` skips it
        from tuner.client import TunerClient

        items = [{"template": template, "template_version": version, "device": device,
                  "problem": problem.to_dict(), "count": count}
                 for (template, version, device, problem), count in batch]
        try:
            with TunerClient(self.url, token="", timeout=self.timeout_s, retries=0) as client:
                answer = client.report_demand(items)
        except ServiceError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                self.refused += sum(count for _, count in batch)
                log.warning("config service %s refused a demand report: %s", self.url, exc)
                return True  # the same report would be refused again
            self._failed(exc)
            return False
        except Exception as exc:  # any transport failure: held for the next report
            self._failed(exc)
            return False
        if self._failing:
            log.info("demand reports to %s go through again", self.url)
            self._failing = False
        self.sent += answer.reports
        self.refused += sum(batch[r.index][1] for r in answer.rejected if r.index < len(batch))
        if answer.rejected:
            log.warning("config service %s refused %d demand item(s), e.g. %s", self.url,
                        answer.rejected_count, answer.rejected[0].reason)
        return True

    def _failed(self, exc: Exception) -> None:
        if not self._failing:
            log.info("demand report to %s failed (%s: %s); held for the next one", self.url,
                     type(exc).__name__, exc)
            self._failing = True

    def _hold_again(self, items: Iterable[tuple[DemandKey, int]]) -> None:
        with self._lock:
            for key, count in items:
                held = self._pending.get(key)
                if held is not None:
                    self._pending[key] = held + count
                elif len(self._pending) < self.max_pending:
                    self._pending[key] = count
                else:
                    self.dropped += count
