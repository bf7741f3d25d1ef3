"""The config service: ``uvicorn --factory api.main:create_app`` (what ``tuner serve`` runs)."""

from __future__ import annotations

import gc
import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.answer_memo import AnswerMemo, ServeKeptAnswers
from api.answers import BestCache
from api.demand_buffer import DemandBuffer
from api.demand_check import DemandChecker
from api.errors import BodySizeLimit, install_error_handlers
from api.loop_share import LoopShare
from api.rate_limit import TokenBuckets
from api.routes import (
    best,
    configs,
    dashboard,
    demand,
    demand_claims,
    devices,
    health,
    kernels,
    reference,
    results,
    snapshots,
    templates,
    winners,
)
from api.store_process import shared_store
from api.warm_up import warm_store, warm_up
from db.session import init_db
from tuner.settings import TOKEN_FIX, Settings, SettingsError, load_settings, write_token_problem

log = logging.getLogger("api")


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app for ``settings`` (default: read from TUNER_* variables); migrates the database."""
    settings = settings if settings is not None else load_settings()
    check_write_token(settings)
    import_template_modules(settings.template_modules)
    init_db(settings.database_url)
    # docs_url=None: /docs is api/routes/reference.py, which needs no CDN (Swagger UI does).
    app = FastAPI(title="attention-tuner", version="1", lifespan=_lifespan, docs_url=None,
                  description="Tuned Triton attention configs per GPU and problem shape.")
    app.state.settings = settings
    store = app.state.bundle_store = shared_store()  # uploads: stored in a process of their own
    app.state.best_cache = BestCache(settings.database_url,
                                     own_changes=partial(store.own.owns, settings.database_url))
    app.state.answer_memo = AnswerMemo()  # filled by the route, answered from in front of it
    app.state.demand_checker = DemandChecker()
    app.state.demand_buffer = DemandBuffer(settings.database_url,
                                           max_pending=settings.demand_max_pending)
    app.state.demand_share = LoopShare()  # reports counted one at a time, in slices
    # Bursts of two seconds' worth: a job's ranks on one host report at about the same time.
    app.state.demand_limiter = TokenBuckets(settings.demand_rate_limit,
                                            max(1.0, 2 * settings.demand_rate_limit))
    app.state.refusal_limiter = TokenBuckets(settings.refused_write_rate,
                                             max(1.0, 2 * settings.refused_write_rate))
    app.state.held_refusals = 0
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       path_limits={"/v1/demand": demand.MAX_BODY_BYTES})
    app.add_middleware(ServeKeptAnswers)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"])
    install_error_handlers(app)
    for module in (health, devices, templates, best, winners, configs, results, snapshots,
                   demand, demand_claims, kernels, dashboard, reference):
        app.include_router(module.router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Pay the write routes' first-request costs now, and start the upload store process
    (api.warm_up); store the demand counts
    still held when the app stops (api.demand_buffer), and close the best cache's change
    watch.

    Keep what start-up allocated (torch, triton, the templates: ~400,000 objects) out of the
    garbage collector's full collections while the app serves. Each full collection traversed
    them all and stopped every request for ~220 ms, which a large upload triggers every few
    seconds (2-core VM: 8,000-item upload, event-loop lag 220 ms; frozen, 12-35 ms). Unfrozen
    at shutdown, so that the interpreter's exit frees them as usual."""
    # Before the freeze: what it builds is kept out of the full collections too.
    app.state.warmed_up = await warm_up(app)
    app.state.store_pid = await warm_store(app.state.bundle_store, app.state.settings)
    froze = gc.get_freeze_count() == 0  # not already frozen by another app of this process
    if froze:
        gc.collect()
        gc.freeze()
    try:
        yield
        await app.state.demand_buffer.flush()
    finally:
        app.state.best_cache.close()
        if froze:
            gc.unfreeze()


def check_write_token(settings: Settings) -> None:
    """Refuse to start with a token the service would refuse for every write; without one,
    start for reads only (writes answer 503) and say so."""
    if settings.token is None:
        log.warning("TUNER_TOKEN is not set: serving reads only, every write answers 503")
        return
    problem = write_token_problem(settings.token)
    if problem is not None:
        raise SettingsError(f"{problem}; {TOKEN_FIX}")


def import_template_modules(modules: list[str]) -> None:
    """Import the modules that register templates from outside the ``templates`` package.

    A sweep imports its spec's ``template_modules`` itself; the service must import the same
    ones (TUNER_TEMPLATE_MODULES), or it answers 404 for the templates they register.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise SettingsError(f"TUNER_TEMPLATE_MODULES: cannot import {module!r} ({exc}); "
                                "install it or fix the module name") from exc
