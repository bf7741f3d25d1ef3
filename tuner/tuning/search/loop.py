"""The search of one problem: ask the study for configs, measure the new ones, tell it.

For every config the sampler suggests, in this order:

  1. another worker holds the same config right now (a RUNNING trial of the study with a
     lower number): this trial is dropped (told FAIL, ``source=deferred``) and the other
     worker's result will be stored. Checked before 2: a worker stores its result before it
     tells the study, so a config that is no longer RUNNING elsewhere is found by 2;
  2. the store already has a result for it (measured earlier, by any worker or sweep): the
     study is told that result, nothing runs, and the nearest config not yet tried is
     enqueued so the next ask measures something new;
  3. a static constraint rejects it: stored as ``invalid`` with the reason, never compiled;
  4. otherwise the runner measures it; the result is stored (with the refreshed best config)
     before the study is told.

The search runs over a ``SearchSpace``, the template's whole space unless a sweep spec
narrows it: only its configs are suggested, enqueued first and counted as results.
The study is told TFLOP/s, 0 for every config that did not give one, so the sampler learns
to avoid those regions. The loop ends when ``budget`` configs have results (invalid ones
not counted), when every valid config has one, or when the sampler keeps repeating itself.
With ``lookahead`` > 0 that many trials are asked ahead and their configs compiled on other
cores while the current one is timed.

Then the finalists (``db.finalists``): the ``finalists`` configs of the problem with the
fastest first readings (any space, any sweep), and the default config, are measured
``final_repeats`` times more, each time as a trial (inputs made afresh, the reference
check), and the best is chosen by the median of each finalist's readings: the fastest of many
single readings is biased to a lucky one. A re-measurement that fails disqualifies its config (the
reason logged and stored; its first measurement stays) and the next config takes its place.
Every re-measurement is stored as it finishes, and which finalist still lacks some is read
from the store before each one: a search resumed after a kill runs only the missing ones, and
a search that ends with its budget already met (a rerun) completes them. Each worker that
ends a problem's search runs this round, claiming each re-measurement before it measures
(``ResultStore.claim_remeasurement``): a claim is granted while the finalist's stored
re-measurements and live claims are fewer than asked, so workers that end together share
the re-measurements and each finalist gets exactly ``final_repeats``. A claim is renewed
while its worker measures; one of a dead worker (its process gone, on this host, or silent
for three renewal intervals) is taken over. The round is skipped when the search was
stopped.

Several workers on one problem measure at most ``budget`` configs in all: a config is not
measured while the results and the configs other workers hold ahead of it (RUNNING trials
with lower numbers, without results yet) already make up the budget; its trial is released,
and the worker waits while the configs of others are in flight.

Every trial of a problem, search and finalists, asks for one seed (``inputs_seed``: the
problem key and ``SearchSettings.seed``, or a salt drawn once per process), so that the
trial worker computes the problem's reference once and keeps it for the next trials
(``tuner.tuning.runner.reference_cache``, which also keeps a repeated seed from reading an
earlier run's output in freed memory).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import optuna
from optuna.trial import TrialState

from db.finalists import pick_finalists
from db.models import TrialStatus
from templates.base import KernelConfig, Problem, Template
from templates.device import DeviceInfo
from tuner.tuning.runner.compile_ahead import CompileAhead
from tuner.tuning.runner.measure import describe_exception
from tuner.tuning.runner.outcome import PhaseTotals, Runner, TrialOutcome, TrialRequest
from tuner.tuning.search.space import (
    SearchSpace,
    distributions,
    neighbours,
    params_of,
    valid_configs,
)
from tuner.tuning.search.store import (
    ProblemBest,
    RemeasurementRecord,
    ResultStore,
    StoredResult,
    TrialRecord,
    measured_configs,
)
from tuner.tuning.search.study import (
    GRACE_PERIOD_S,
    HeartbeatKeeper,
    fail_stale_trials,
    retry_locked,
)

__all__ = [
    "DEFAULT_FINALISTS",
    "DEFAULT_FINAL_REPEATS",
    "ProblemSearch",
    "SearchSettings",
    "SearchStats",
    "TrialEvent",
    "ValidConfigs",
    "inputs_seed",
]

# A search space's valid configs in grid order and their keys (None, []: not enumerated).
ValidConfigs = tuple[list[KernelConfig] | None, list[str]]

log = logging.getLogger(__name__)

# How often a worker renews its claim on the re-measurement it runs, when it keeps no Optuna
# heartbeats (then their interval); a claim silent for 3x as long is a dead worker's.
CLAIM_RENEW_S = 10.0

# Finalists per problem and the re-measurements of each: with the first reading, a median of 3.
# Issue 6: of 4 H100 bests measured once, one re-measured 5.5% slower (1.066 vs 1.011 ms).
DEFAULT_FINALISTS = 3
DEFAULT_FINAL_REPEATS = 2

# Salts the inputs' seeds of searches without a seed: drawn once per process, so that the
# passes of one problem in one sweep (a probe, then its search) share theirs.
_SEED_SALT = random.SystemRandom().randrange(2**31)


def inputs_seed(problem_key: str, seed: int | None) -> int:
    """The seed of every trial's inputs of a problem: one per problem key and search seed."""
    salt = _SEED_SALT if seed is None else seed
    return random.Random(f"{salt}|{problem_key}").randrange(2**31)


@dataclass(frozen=True)
class SearchSettings:
    budget: int  # configs with results wanted for the problem (invalid ones not counted)
    timeout_s: float = 300.0  # per trial, compile included
    lookahead: int = 0  # trials asked ahead of the one being measured (compile-ahead)
    seed: int | None = None
    max_asks: int | None = None  # default: 4 x budget + 40
    # How often to fail trials of dead workers (Optuna's optimize() does it every trial);
    # about half the storage's grace period.
    stale_check_s: float = GRACE_PERIOD_S / 2
    # While every config still without a result is held by another worker: how often to look
    # again (their results land, or their dead workers' trials go stale and are retried),
    # and for how long at most (default: twice the trial timeout plus a minute; no live
    # worker holds a config that long).
    wait_poll_s: float = 0.5
    max_wait_s: float | None = None
    # How long to wait for another worker's just-asked trial to get its params (written
    # right after the trial is created, so milliseconds unless that worker died).
    params_wait_s: float = 2.0
    # Enqueue the default and known good configs first (a sweep never ends worse than the
    # default). False only to study a sampler on its own (benchmarks/tpe_vs_grid.py).
    default_first: bool = True
    # After the search: configs with the fastest first readings measured again (the default
    # too), and how many times each; 0 finalists: off (the best is the fastest single reading).
    finalists: int = DEFAULT_FINALISTS
    final_repeats: int = DEFAULT_FINAL_REPEATS
    # A sweep's time budget (time.monotonic() instants; tuner.tuning.search.budget): past
    # ``deadline`` the search asks for no new config once the problem has a result (its time
    # share is spent; the finalists' re-measurements, at this search's pace, are kept within
    # it); past ``hard_deadline`` (the whole sweep's) nothing new is measured at all. A
    # measurement started before either runs to its end and is stored.
    deadline: float | None = None
    hard_deadline: float | None = None

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, but got {self.budget}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, but got {self.timeout_s}")
        if self.finalists < 0:
            raise ValueError(f"finalists must be >= 0, but got {self.finalists}")
        if self.final_repeats < 1:
            raise ValueError(f"final_repeats must be >= 1, but got {self.final_repeats}")


@dataclass
class SearchStats:
    """What one worker did on one problem."""

    budget: int = 0  # the budget, capped by the number of valid configs
    measured: int = 0  # configs this worker ran
    reused: int = 0  # suggestions answered from stored results
    invalid: int = 0  # configs rejected by a static constraint
    deferred: int = 0  # suggestions held by another worker at the time
    asks: int = 0
    wall_s: float = 0.0
    bench_s: float = 0.0
    runner_s: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)  # of the configs run here
    remeasured: int = 0  # re-measurements of finalists this worker ran
    disqualified: int = 0  # of which failed (their configs disqualified)
    final_s: float = 0.0  # seconds spent on them (not in wall_s)
    # Where the worker time of the measured configs, and of the re-measurements, went
    phases: PhaseTotals = field(default_factory=PhaseTotals)
    final_phases: PhaseTotals = field(default_factory=PhaseTotals)
    best: ProblemBest | None = None
    budget_spent: bool = False  # the search ended at its deadline (SearchSettings)
    measure_s: float = 0.0  # wall seconds of this worker's measurements (the sweep's pace)


@dataclass(frozen=True)
class TrialEvent:
    """One suggestion handled; ``results`` is the problem's count of configs with results."""

    problem_key: str
    source: str  # measured, stored, invalid, deferred; final: a finalist re-measured
    config_key: str
    status: str | None
    tflops: float | None
    results: int
    budget: int
    best_tflops: float | None
    reason: str = ""


class ProblemSearch:
    """Tunes one problem of one template on one device, sharing its study with any number
    of other workers (threads, processes or hosts)."""

    def __init__(self, *, template: Template, problem: Problem, device: DeviceInfo,
                 study: optuna.Study, store: ResultStore, runner: Runner,
                 settings: SearchSettings, compile_ahead: CompileAhead | None = None,
                 heartbeats: HeartbeatKeeper | None = None,
                 on_trial: Callable[[TrialEvent], None] | None = None,
                 stop: threading.Event | None = None,
                 space: SearchSpace | None = None,
                 prior: Sequence[KernelConfig] = (),
                 on_measure: Callable[[float], None] | None = None,
                 valid: ValidConfigs | None = None) -> None:
        self.template = template
        self.problem = problem
        self.problem_key = template.problem_key(problem)
        self.device = device
        self.study = study
        self.store = store
        self.runner = runner
        self.settings = settings
        self.compile_ahead = compile_ahead
        self.heartbeats = heartbeats
        self.on_trial = on_trial or (lambda event: None)
        self.stop = stop or threading.Event()
        self.stats = SearchStats()
        # Measured first after the default, before the known good configs
        # (tuner.tuning.search.prior)
        self.prior = tuple(prior)
        self.on_measure = on_measure or (lambda seconds: None)
        self._rng = random.Random(settings.seed)
        self._inputs_seed = inputs_seed(self.problem_key, settings.seed)
        # The study's sampler must draw from the same space (make_sampler(..., space)).
        self.space = space or SearchSpace.full(template.config_cls)
        self._dists = distributions(self.space)
        self._default = template.default_config(problem, device)
        self._mine: set[int] = set()  # numbers of the trials this loop holds
        # The space's valid configs and their keys (config.key() is not free: computed once):
        # given (a sweep's earlier search of the same task, its probe) or worked out once by
        # ``valid``, which ``effective_budget`` calls before the search reads them.
        self._enumerated = valid
        self._budget: int | None = None
        self._last_stale_check = 0.0
        # Who holds this search's claims on re-measurements: host and process first, so that a
        # worker on the same host can tell a dead holder's claims at once.
        self._claimant = f"{socket.gethostname()}|{os.getpid()}|{uuid.uuid4().hex[:8]}"
        self._claim_renew_s = heartbeats.interval_s if heartbeats is not None else CLAIM_RENEW_S

    def effective_budget(self) -> int:
        """The budget, capped by the number of configs of the space that the constraints let
        through."""
        if self._budget is None:
            configs, _ = self.valid()
            self._budget = self.settings.budget
            if configs is not None:
                self._budget = min(self._budget, len(configs))
        return self._budget

    @property
    def _valid(self) -> list[KernelConfig] | None:
        return None if self._enumerated is None else self._enumerated[0]

    @property
    def _valid_keys(self) -> list[str]:
        return [] if self._enumerated is None else self._enumerated[1]

    def valid(self) -> ValidConfigs:
        """The configs of the space the constraints let through, in grid order, and their
        keys (None, []: a space too large to enumerate); worked out once (a space of 50k-75k
        configs takes a few tenths of a second), and handed by a sweep from a task's probe to
        its search."""
        if self._enumerated is None:
            configs = valid_configs(self.space, self._constraint)
            self._enumerated = (configs, [c.key() for c in configs] if configs is not None
                                else [])
        return self._enumerated

    def known(self) -> dict[str, StoredResult]:
        """The stored results of the problem (any sweep, any worker) inside the space: results
        outside it, of searches over other spaces, neither count towards the budget nor
        inform this search."""
        known = self.store.known(self.problem_key)
        if self.space.is_full:
            return known
        return {key: r for key, r in known.items() if self.space.contains(r.config)}

    def results(self, known: dict[str, StoredResult] | None = None) -> int:
        """Configs of the space with results (invalid ones do not count)."""
        known = self.known() if known is None else known
        return sum(1 for r in known.values() if r.status != TrialStatus.INVALID)

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> SearchStats:
        """The search, then the finalists' round unless stopped; see the module docstring."""
        try:
            self._search()
            if not self.stop.is_set():
                self._final_round()
        finally:
            self.stats.best = self.store.best(self.problem_key)
        return self.stats

    def _search(self) -> None:
        start = time.monotonic()
        self._fail_stale(force=True)
        budget = self.stats.budget = self.effective_budget()
        max_asks = self.settings.max_asks or 4 * budget + 40
        max_wait = self.settings.max_wait_s or 2 * self.settings.timeout_s + 60
        waiting_since: float | None = None
        known = self.known()
        if self.settings.default_first:
            self._enqueue_first(known)
        queue: deque[tuple[optuna.Trial, KernelConfig | None]] = deque()
        try:
            while not self.stop.is_set():
                known = self.known()
                results = self.results(known)
                if results >= budget or self._exhausted(known):
                    break
                if self._past_deadline(results):
                    self.stats.budget_spent = True
                    log.info("%s: its share of the sweep's time budget is spent; the best so "
                             "far stands (%d results)", self.problem_key, results)
                    break
                self._fail_stale()
                in_flight = self._in_flight_elsewhere(known)
                if not queue and (results + in_flight >= budget
                                  or self._rest_held_elsewhere(known)):
                    waiting_since = waiting_since or time.monotonic()
                    if time.monotonic() - waiting_since > max_wait:
                        log.warning("%s: configs held by other workers for %.0f s; leaving "
                                    "them (a later run resumes)", self.problem_key, max_wait)
                        break
                    self.stop.wait(self.settings.wait_poll_s)
                    continue
                waiting_since = None
                want = min(1 + self.settings.lookahead, budget - results - in_flight)
                while len(queue) < want and self.stats.asks < max_asks:
                    queue.append(self._ask())
                if not queue:
                    log.info("%s: the sampler kept repeating configs with results; stopping "
                             "after %d asks", self.problem_key, self.stats.asks)
                    break
                self._compile_ahead(list(queue)[1:], known)
                trial, config = queue.popleft()
                self._handle(trial, config, results, budget)
        finally:
            for trial, _ in queue:  # asked ahead, never run: free them for other workers
                self._tell(trial, None, state=TrialState.FAIL, source="unused")
            self.stats.wall_s += time.monotonic() - start

    def _past_deadline(self, results: int) -> bool:
        """Whether the sweep's time budget stops the search here (SearchSettings.deadline)."""
        now = time.monotonic()
        hard, soft = self.settings.hard_deadline, self.settings.deadline
        if hard is not None and now >= hard:
            return True
        if soft is None or results < 1:
            return False
        measured = self.stats.measured + self.stats.remeasured
        pace = self.stats.measure_s / measured if measured else 0.0
        finals = (self.settings.final_repeats * (self.settings.finalists + 1)
                  if self.settings.finalists else 0)
        return now + pace * finals >= soft

    def firsts(self) -> int:
        """How many configs the search measures first (the default, the prior, the known
        good ones) that lie in its space: a probe's budget."""
        keys = {c.key() for c in self._firsts() if self.space.contains(c.to_dict())}
        return max(1, len(keys))

    def _firsts(self) -> list[KernelConfig]:
        return [self._default, *self.prior,
                *self.template.known_good_configs(self.problem, self.device)]

    def _exhausted(self, known: dict[str, Any]) -> bool:
        return self._valid is not None and all(key in known for key in self._valid_keys)

    def _constraint(self, config: KernelConfig) -> str | None:
        try:
            return self.template.constraint(self.problem, config, self.device)
        except Exception as exc:  # a constraint that raises rejects the config, with why
            return f"the constraint check raised {describe_exception(exc)}"

    # -- asking and telling -----------------------------------------------------------------
    def _ask(self) -> tuple[optuna.Trial, KernelConfig | None]:
        with warnings.catch_warnings():
            # Optuna warns that heartbeats are meant for optimize(); HeartbeatKeeper keeps
            # them for ask/tell.
            warnings.filterwarnings("ignore", message="Heartbeat of storage", category=UserWarning)
            trial = retry_locked(lambda: self.study.ask(self._dists))
        self.stats.asks += 1
        self._mine.add(trial.number)
        if self.heartbeats is not None:
            self.heartbeats.hold(trial._trial_id)
        try:
            config: KernelConfig | None = self.template.config(trial.params)
        except ValueError as exc:  # an enqueued config from elsewhere that the space refuses
            log.warning("trial %d has params outside the space: %s", trial.number, exc)
            config = None
        return trial, config

    def _tell(self, trial: optuna.Trial, value: float | None, *, source: str,
              state: TrialState | None = None, **attrs: Any) -> None:
        try:
            # One attribute per write: "source" (measured, stored, invalid, deferred, ...)
            # and, where there is one, "result" (status, config key, reason).
            trial.set_user_attr("source", source)
            if attrs:
                trial.set_user_attr("result", attrs)
            if state is None:
                retry_locked(lambda: self.study.tell(trial, value, skip_if_finished=True))
            else:
                retry_locked(lambda: self.study.tell(trial, state=state,
                                                     skip_if_finished=True))
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker failed it as stale (this one was too slow to beat); what was
            # measured is stored all the same.
            log.warning("trial %d was finished by another worker", trial.number)
        finally:
            self._mine.discard(trial.number)
            if self.heartbeats is not None:
                self.heartbeats.release(trial._trial_id)

    def _enqueue_first(self, known: dict[str, Any]) -> None:
        """The default config and the template's known good ones go first, so a sweep never
        ends worse than the default; those of them that lie in the space."""
        pending = {self._key_of(t.params) for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING,
                                    TrialState.COMPLETE))}
        seen: set[str] = set()
        for config in self._firsts():
            key = config.key()
            if key in known or key in pending or key in seen:
                continue
            if not self.space.contains(config.to_dict()):
                log.info("%s: %s is outside the search space; not enqueued", self.problem_key,
                         key)
                continue
            seen.add(key)
            retry_locked(functools.partial(self.study.enqueue_trial, params_of(config)))

    def _key_of(self, params: dict[str, Any]) -> str | None:
        try:
            return self.template.config(params).key()
        except ValueError:
            return None

    def _fail_stale(self, force: bool = False) -> None:
        # Optuna's optimize() checks before every trial; twice per grace period is enough here.
        now = time.monotonic()
        if force or now - self._last_stale_check > self.settings.stale_check_s:
            self._last_stale_check = now
            fail_stale_trials(self.study)

    # -- one suggestion -------------------------------------------------------------------
    def _handle(self, trial: optuna.Trial, config: KernelConfig | None, results: int,
                budget: int) -> None:
        if config is None:
            self._tell(trial, None, state=TrialState.FAIL, source="outside-space")
            return
        key = config.key()
        holder = self._held_elsewhere(trial, key)
        if holder is not None:
            self.stats.deferred += 1
            self._tell(trial, None, state=TrialState.FAIL, source="deferred",
                       held_by_trial=holder)
            self._emit("deferred", key, None, None, results, budget)
            return
        stored = self.store.find(self.problem_key, key)
        if stored is not None:
            self.stats.reused += 1
            self._tell(trial, stored.value, source="stored", status=stored.status.value,
                       config_key=key)
            self._enqueue_untried(config)
            self._emit("stored", key, stored.status.value, stored.tflops, results, budget)
            return
        reason = self._constraint(config)
        if not reason and self._budget_taken_ahead_of(trial, budget):
            # Released, not measured: the worker waits in _search for the others' results.
            self.stats.deferred += 1
            self._tell(trial, None, state=TrialState.FAIL, source="over-budget")
            self._emit("over-budget", key, None, None, results, budget)
            return
        if reason:
            self.stats.invalid += 1
            outcome = TrialOutcome.failed(TrialStatus.INVALID, reason)
        else:
            outcome = self._measure(config)
            if self.stop.is_set() and not outcome.ok:
                # Interrupted: the runner was torn down under this trial; nothing to store.
                self._tell(trial, None, state=TrialState.FAIL, source="interrupted")
                return
            self.stats.measured += 1
            self.stats.statuses[outcome.status.value] += 1
            self.stats.bench_s += outcome.bench_s
            self.stats.runner_s += outcome.runner_s
            self.stats.phases.add(outcome)
            results += 1
        best = self.store.record(TrialRecord(
            problem=self.problem, problem_key=self.problem_key, config=config, outcome=outcome,
            is_default=key == self._default.key(), study=self.study.study_name,
            trial_number=trial.number))
        value = outcome.tflops if outcome.ok and outcome.tflops else 0.0
        self._tell(trial, value, source="invalid" if reason else "measured",
                   status=outcome.status.value, config_key=key,
                   reason=outcome.reason[:500])
        self._emit("invalid" if reason else "measured", key, outcome.status.value,
                   outcome.tflops, results, budget, best.tflops if best else None,
                   outcome.reason)

    # -- the finalists ----------------------------------------------------------------------
    def _final_round(self) -> None:
        """Re-measure the finalists until each has ``final_repeats`` re-measurements."""
        if self.settings.finalists == 0:
            return
        start = time.monotonic()
        results, budget = self.results(), self.stats.budget
        try:
            while not self.stop.is_set():
                hard = self.settings.hard_deadline
                if hard is not None and time.monotonic() >= hard:
                    self.stats.budget_spent = True
                    break
                finalist = self._next_finalist()
                if finalist is None or not self._remeasure(finalist, results, budget):
                    break
        finally:
            self.stats.final_s += time.monotonic() - start

    def _next_finalist(self) -> tuple[StoredResult, int] | None:
        """The first finalist, fastest first, still short of re-measurements that this worker
        could claim one more of, and the claim; read afresh each time, as other workers may be
        re-measuring too (a finalist whose missing re-measurements they all hold is passed)."""
        known = self.store.known(self.problem_key)  # the problem's, whatever space found them
        again = self.store.remeasurements(self.problem_key)
        for finalist in pick_finalists(measured_configs(known, again), self.settings.finalists):
            if len(finalist.remeasured_ms) >= self.settings.final_repeats:
                continue
            claim = self.store.claim_remeasurement(
                self.problem_key, str(finalist.ref), wanted=self.settings.final_repeats,
                worker=self._claimant, is_stale=self._claim_is_stale)
            if claim is not None:
                return known[str(finalist.ref)], claim
        return None

    def _claim_is_stale(self, holder: str, renewed_at: datetime) -> bool:
        """Whether another worker's claim is abandoned: not renewed for three intervals, or
        held by a process of this host that is gone (a killed sweep's claims are taken over
        at once by the next run on its host)."""
        if datetime.now(UTC) - renewed_at > timedelta(seconds=3 * self._claim_renew_s):
            return True
        host, _, rest = holder.partition("|")
        pid = rest.partition("|")[0]
        return host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))

    @contextlib.contextmanager
    def _claim_renewed(self, claim: int) -> Iterator[None]:
        """Renew ``claim`` every interval while the block runs (a measurement may take
        minutes)."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self._claim_renew_s):
                try:
                    self.store.renew_claim(claim)
                except Exception as exc:  # a missed renewal is tried again next interval
                    log.debug("renewing claim %d failed: %s", claim, exc)

        thread = threading.Thread(target=renew, name="claim-renewal", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)

    def _remeasure(self, picked: tuple[StoredResult, int], results: int, budget: int) -> bool:
        """Measure a finalist once more under its claim and store it; False when interrupted
        (nothing stored, the claim given up)."""
        finalist, claim = picked
        config = self.template.config(finalist.config)
        started = time.monotonic()
        try:
            with self._claim_renewed(claim):
                outcome = self.runner.measure(self._request(config), self.settings.timeout_s)
            self._measured_for(time.monotonic() - started)
        except BaseException:
            self.store.drop_claim(claim)
            raise
        if self.stop.is_set() and not outcome.ok:
            self.store.drop_claim(claim)
            return False  # the runner was torn down under it, as in _handle
        self.stats.remeasured += 1
        self.stats.final_phases.add(outcome)
        if not outcome.ok:
            self.stats.disqualified += 1
            log.warning("%s: finalist %s is disqualified: re-measured, it gave %s (%s); its "
                        "first measurement stays stored", self.problem_key, finalist.config_key,
                        outcome.status.value, outcome.reason)
        best = self.store.record_remeasurement(RemeasurementRecord(
            problem_key=self.problem_key, config_key=finalist.config_key, outcome=outcome,
            claim=claim))
        self._emit("final", finalist.config_key, outcome.status.value, outcome.tflops, results,
                   budget, best.tflops if best else None, outcome.reason)
        return True

    def _running_elsewhere(self) -> dict[str, int]:
        """Config key -> number of the RUNNING trials of other workers (not this loop's)."""
        held: dict[str, int] = {}
        for other in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            key = self._key_of(other.params)
            if other.number not in self._mine and key is not None:
                held[key] = min(other.number, held.get(key, other.number))
        return held

    def _in_flight_elsewhere(self, known: dict[str, Any], *,
                             before: int | None = None) -> int:
        """Configs that other workers hold without a result yet (RUNNING trials not this
        loop's, with numbers below ``before`` if given): each will be a result. A trial whose
        params are not written yet counts too."""
        held: set[str | int] = set()
        for other in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if other.number in self._mine or (before is not None and other.number >= before):
                continue
            if not self._dists.keys() <= other.params.keys():
                held.add(other.number)
                continue
            key = self._key_of(other.params)
            if key is not None and key not in known:
                held.add(key)
        return len(held)

    def _budget_taken_ahead_of(self, trial: optuna.Trial, budget: int) -> bool:
        """Whether the results and the configs other workers hold ahead of ``trial`` (lower
        numbers: of two workers that draw at once, the first runs) make up the budget."""
        known = self.known()
        return self.results(known) + self._in_flight_elsewhere(
            known, before=trial.number) >= budget

    def _rest_held_elsewhere(self, known: dict[str, Any]) -> bool:
        """True when every valid config without a result is held by another worker: asking
        would only repeat them. Their results will land, or, if that worker died, its trials
        go stale, are failed and re-enqueued (the storage's retry callback)."""
        if self._valid is None:
            return False
        untried = [key for key in self._valid_keys if key not in known]
        if not untried:
            return False
        held = self._running_elsewhere()
        if all(key in held for key in untried):
            self._fail_stale()
            return True
        return False

    def _held_elsewhere(self, trial: optuna.Trial, key: str) -> int | None:
        """The number of a RUNNING trial of another worker that holds ``key`` and goes first
        (the one that started running first, by its stored start and then its number: both
        workers order the same two rows alike, so of two that drew one config exactly one
        runs it). Not the lower number alone: an enqueued trial keeps the number of its
        enqueuing and starts when a worker pops it, maybe after another worker's fresh trial
        of the same config started and checked (both measured it: CI's fleet test of
        2026-12-01, two workers on one problem after a lease ran out).

        ``study.ask`` creates a trial RUNNING and writes its params afterwards, so an earlier
        trial may be seen without them (seen with three processes on one SQLite file: both
        workers measured one config). Its config is then unknown: look again until its
        params land; one that stays without them for ``params_wait_s`` goes first all the
        same (this trial is dropped), until the stale check fails it as an orphan.
        """
        deadline = time.monotonic() + self.settings.params_wait_s
        while True:
            unknown: int | None = None
            running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            me = next((t for t in running if t.number == trial.number), None)
            for other in running:
                if (other.number == trial.number or other.number in self._mine
                        or not _starts_before(other, me, trial.number)):
                    continue
                if not self._dists.keys() <= other.params.keys():
                    unknown = other.number if unknown is None else min(unknown, other.number)
                elif self._key_of(other.params) == key:
                    return other.number
            if unknown is None or time.monotonic() > deadline or self.stop.is_set():
                return unknown
            self.stop.wait(0.02)

    def _measure(self, config: KernelConfig) -> TrialOutcome:
        request = self._request(config)
        started = time.monotonic()
        if self.compile_ahead is not None:
            self.compile_ahead.wait(self._compile_key(config), self.settings.timeout_s)
        try:
            return self.runner.measure(request, self.settings.timeout_s)
        finally:
            self._measured_for(time.monotonic() - started)

    def _measured_for(self, seconds: float) -> None:
        self.stats.measure_s += seconds
        self.on_measure(seconds)

    def _request(self, config: KernelConfig) -> TrialRequest:
        return TrialRequest(template=self.template.name,
                            template_module=type(self.template).__module__,
                            problem=self.problem.to_dict(), config=config.to_dict(),
                            seed=self._inputs_seed)

    def _compile_key(self, config: KernelConfig) -> tuple[str, str, str]:
        return (self.template.name, self.problem_key, config.key())

    def _compile_ahead(self, upcoming: list[tuple[optuna.Trial, KernelConfig | None]],
                       known: dict[str, Any]) -> None:
        if self.compile_ahead is None or not self.compile_ahead.enabled_for(self.template):
            return
        for _, config in upcoming:
            if config is not None and config.key() not in known and not self._constraint(config):
                self.compile_ahead.submit(self.template, self._compile_key(config),
                                          self._request(config))

    def _enqueue_untried(self, config: KernelConfig) -> None:
        """After a repeat suggestion, queue the closest config without a result, so the next
        ask measures something new instead of repeating (TPE converges on small spaces)."""
        if self._valid is None:
            return
        known = self.known()
        taken = {self._key_of(t.params) for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))}
        untried = [c for c, key in zip(self._valid, self._valid_keys, strict=True)
                   if key not in known and key not in taken]
        if untried:
            nearest = neighbours(config, untried, self._rng)[0]
            retry_locked(lambda: self.study.enqueue_trial(params_of(nearest)))

    def _emit(self, source: str, key: str, status: str | None, tflops: float | None,
              results: int, budget: int, best_tflops: float | None = None,
              reason: str = "") -> None:
        self.on_trial(TrialEvent(problem_key=self.problem_key, source=source, config_key=key,
                                 status=status, tflops=tflops, results=results, budget=budget,
                                 best_tflops=best_tflops, reason=reason))


def _alive(pid: int) -> bool:
    """Whether a process of this host with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


def _starts_before(other: optuna.trial.FrozenTrial, me: optuna.trial.FrozenTrial | None,
                   number: int) -> bool:
    """Whether RUNNING trial ``other`` goes before this worker's trial ``number`` (``me``, as
    read back with it): it started first, or at the same moment with a lower number. Where a
    start is missing (or this trial was not read back) the lower number goes first."""
    if me is None or other.datetime_start is None or me.datetime_start is None:
        return other.number < number
    return (other.datetime_start, other.number) < (me.datetime_start, number)
