from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response

from api.answer_memo import AnswerMemo, KeptAnswer
from api.answers import BestCache, answer_with_sources
from api.comparison_answer import compared_answer
from api.deps import template_or_404
from api.query import openapi_parameters, validated_query
from api.schemas import BestQuery
from tuner.settings import Settings
from tuner.wire import BestOut, ErrorOut

router = APIRouter(prefix="/v1", tags=["configs"])


# The request alone as parameter: FastAPI's resolution of three dependencies (the query model,
# the cache, the settings) was ~20 % of a read's time on the event loop (cProfile, 2026-11-29);
# the parameters are documented from the model all the same (openapi_extra).
@router.get(
    "/best",
    response_model=BestOut,
    openapi_extra=openapi_parameters(BestQuery),
    responses={404: {"model": ErrorOut}, 422: {"model": ErrorOut}},
)
async def best(request: Request) -> Response:
    """The config to run a problem with on a device, and how it was found.

    ``match`` says how: ``exact`` (this problem was tuned), ``bucket`` (a problem of its shape
    bucket was), ``nearest`` (the closest tuned shape of the same dtype, variant, head dim and
    GQA ratio) or ``default`` (nothing tuned: the template's heuristic). A nearest answer
    lists the neighbouring buckets' bests (``neighbours``), on which a client decides which
    implementation runs (docs/DISPATCH.md). With ``compare=true``, ``implementations`` says
    which implementation runs the problem, the runner-up, and every implementation's and SDPA
    backend's time.
    """
    state = request.app.state
    cache: BestCache = state.best_cache
    memo: AnswerMemo = state.answer_memo  # answered from by api.answer_memo.ServeKeptAnswers
    query = validated_query(BestQuery, request)
    template = template_or_404(query.template)
    problem = query.problem()
    why = template.unsupported(problem)
    if why:
        raise HTTPException(
            422, detail=f"template {template.name!r} cannot run this problem: {why}"
        )
    answered = await answer_with_sources(
        cache,
        template=template,
        version=query.template_version,
        problem=problem,
        device=query.device,
    )
    answer = answered.answer
    if query.compare:
        settings: Settings = state.settings
        compared = await compared_answer(cache, problem=problem, device_key=answer.device,
                                         margin=settings.neighbour_margin)
        answer = answer.model_copy(update={"implementations": compared})
    # Serialized here: the answer is already a validated BestOut, and FastAPI's response_model
    # pass would validate it a second time.
    body = answer.model_dump_json().encode()
    if answered.stored_device and not query.compare:
        memo.put(request.scope["query_string"], KeptAnswer.of(body, answered.catalog, template, answered.version,
                                          answer.device, answered.bests))
    return Response(body, media_type="application/json")
