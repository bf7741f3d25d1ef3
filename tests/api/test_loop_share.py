"""Demand reports share the event loop with reads (api.loop_share): one report's work at a
time, given back to the loop in slices. Counted, never timed: pauses and the order of turns."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.loop_share import LoopShare, Slices
from tests.api.serving_data import FWD, H100, problem


def test_a_slice_gives_the_loop_back_only_once_it_is_spent() -> None:
    async def main() -> tuple[int, int, int]:
        ticks = 0

        async def other() -> None:  # what a read is to a report: runs when given the loop
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        never, always = Slices(slice_s=3600.0), Slices(slice_s=1e-12)
        before = ticks
        for _ in range(10):
            await never.pause()
        kept = ticks - before
        for _ in range(10):
            await always.pause()
        task.cancel()
        return kept, always.pauses, ticks - before

    kept, pauses, ran = asyncio.run(main())
    assert kept == 0  # the slice not spent: the loop was not given back
    assert pauses == 10 and ran >= 10  # spent each time: the other task ran between


def test_turns_are_taken_one_at_a_time_in_arrival_order() -> None:
    share = LoopShare(slice_s=1e-12)
    log: list[str] = []

    async def report(name: str) -> None:
        async with share.turn() as slices:
            log.append(f"{name} in")
            for _ in range(3):
                await slices.pause()
            log.append(f"{name} out")

    async def main() -> None:
        await asyncio.gather(*(report(n) for n in "abc"))

    asyncio.run(main())
    assert log == ["a in", "a out", "b in", "b out", "c in", "c out"]
    asyncio.run(main())  # the same share on another loop (a test client's next portal)
    assert log[6:] == log[:6]


def test_a_slice_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slice_s"):
        LoopShare(slice_s=0)


class RecordingShare(LoopShare):
    def __init__(self) -> None:
        super().__init__(slice_s=1e-12)
        self.given: list[Slices] = []

    @asynccontextmanager
    async def turn(self) -> Any:
        async with super().turn() as slices:
            self.given.append(slices)
            yield slices


def test_a_report_gives_the_loop_back_between_its_items(app: FastAPI,
                                                        client: TestClient) -> None:
    share = app.state.demand_share = RecordingShare()
    items = [{"template": FWD.name, "template_version": FWD.version(), "device": H100.key,
              "problem": problem(1000 + 64 * i).to_dict(), "count": 1} for i in range(40)]
    answer = client.post("/v1/demand", json={"items": items})
    assert answer.status_code == 202, answer.text
    assert answer.json()["reports"] == 40
    (slices,) = share.given
    assert slices.pauses >= 2 * len(items)  # after each item's check, and after its count
