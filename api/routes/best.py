from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Response

from api.answers import best_answer
from api.compared import compared_answer
from api.deps import BestCacheDep, SettingsDep, template_or_404
from api.query import openapi_parameters, parse_query
from api.schemas import BestQuery
from tuner.wire import BestOut, ErrorOut

router = APIRouter(prefix="/v1", tags=["configs"])


@router.get(
    "/best",
    response_model=BestOut,
    openapi_extra=openapi_parameters(BestQuery),
    responses={404: {"model": ErrorOut}, 422: {"model": ErrorOut}},
)
async def best(
    query: Annotated[BestQuery, Depends(parse_query(BestQuery))],
    cache: BestCacheDep,
    settings: SettingsDep,
) -> Response:
    """The config to run a problem with on a device, and how it was found.

    ``match`` says how: ``exact`` (this problem was tuned), ``bucket`` (a problem of its shape
    bucket was), ``nearest`` (the closest tuned shape of the same dtype, variant, head dim and
    GQA ratio) or ``default`` (nothing tuned: the template's heuristic). A nearest answer
    lists the neighbouring buckets' bests (``neighbours``), on which a client decides which
    implementation runs (docs/DISPATCH.md). With ``compare=true``, ``implementations`` says
    which implementation runs the problem, the runner-up, and every implementation's and SDPA
    backend's time.
    """
    template = template_or_404(query.template)
    problem = query.problem()
    why = template.unsupported(problem)
    if why:
        raise HTTPException(
            422, detail=f"template {template.name!r} cannot run this problem: {why}"
        )
    answer = await best_answer(
        cache,
        template=template,
        version=query.template_version,
        problem=problem,
        device=query.device,
    )
    if query.compare:
        compared = await compared_answer(cache, problem=problem, device_key=answer.device,
                                         margin=settings.neighbour_margin)
        answer = answer.model_copy(update={"implementations": compared})
    # Serialized here: the answer is already a validated BestOut, and FastAPI's response_model
    # pass would validate it a second time.
    return Response(answer.model_dump_json(), media_type="application/json")
