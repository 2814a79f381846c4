"""``@lord.region(name)`` on generator functions, ``async def`` and async generators:
the region measures the iteration / the awaited body, and the wrapper is of the same kind
as the function (what ``inspect`` says is kept) (repro r30)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from memlord import MemLord


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()  # the outside reference: torch's own size


def test_generator_function_measures_the_iteration_and_stays_a_generator_function() -> None:
    lord = MemLord()
    made: list[torch.Tensor] = []

    def produce(n: int):
        for _ in range(n):
            t = torch.empty(1000, dtype=torch.uint8)
            lord.allocate(t)
            made.append(t)
            yield t

    wrapped = lord.region("gen")(produce)
    assert inspect.isgeneratorfunction(wrapped)
    assert wrapped.__wrapped__ is produce
    gen = wrapped(3)
    assert "gen" not in lord.regions()  # nothing runs before the first next()
    items = list(gen)
    assert len(items) == 3
    agg = lord.regions()["gen"]
    assert agg["count"] == 1
    assert agg["devices"]["cpu"]["total_delta"] == sum(_nbytes(t) for t in made) == 3000


def test_generator_send_throw_close_and_return_value_reach_the_inner_generator() -> None:
    lord = MemLord()
    log: list = []

    @lord.region("echo")
    def echo():
        try:
            while True:
                try:
                    got = yield "ready"
                    log.append(got)
                except ValueError as exc:
                    log.append(("caught", str(exc)))
        finally:
            log.append("closed")

    g = echo()
    assert next(g) == "ready"
    assert g.send(5) == "ready"
    assert g.throw(ValueError("x")) == "ready"
    g.close()
    assert log == [5, ("caught", "x"), "closed"]
    assert lord.regions()["echo"]["count"] == 1

    @lord.region("ret")
    def ret():
        yield 1
        return "done"

    g = ret()
    next(g)
    with pytest.raises(StopIteration) as info:
        next(g)
    assert info.value.value == "done"
    assert lord.regions()["ret"]["count"] == 1


def test_coroutine_function_measures_the_awaited_body_and_stays_a_coroutine_function() -> None:
    lord = MemLord()
    made: list[torch.Tensor] = []

    async def work(n: int) -> int:
        await asyncio.sleep(0)
        t = torch.empty(n, dtype=torch.uint8)
        lord.allocate(t)
        made.append(t)
        return n

    wrapped = lord.region("coro")(work)
    assert inspect.iscoroutinefunction(work)
    assert inspect.iscoroutinefunction(wrapped)
    assert asyncio.run(wrapped(1000)) == 1000
    agg = lord.regions()["coro"]
    assert agg["count"] == 1
    assert agg["devices"]["cpu"]["total_delta"] == _nbytes(made[0]) == 1000

    @lord.region("fails")
    async def fails() -> None:
        await asyncio.sleep(0)
        raise KeyError("k")

    with pytest.raises(KeyError):
        asyncio.run(fails())
    assert lord.regions()["fails"]["count"] == 1


def test_async_generator_measures_the_iteration_and_stays_an_async_generator_function() -> None:
    lord = MemLord()
    made: list[torch.Tensor] = []

    async def stream(n: int):
        for i in range(n):
            await asyncio.sleep(0)
            t = torch.empty(500, dtype=torch.uint8)
            lord.allocate(t)
            made.append(t)
            got = yield i
            if got is not None:
                made.append(got)

    wrapped = lord.region("agen")(stream)
    assert inspect.isasyncgenfunction(wrapped)
    assert not inspect.iscoroutinefunction(wrapped)

    async def consume() -> list:
        out = [i async for i in wrapped(4)]
        g = wrapped(3)
        first = await g.asend(None)
        second = await g.asend("sent")
        await g.aclose()
        return [out, first, second]

    assert asyncio.run(consume()) == [[0, 1, 2, 3], 0, 1]
    agg = lord.regions()["agen"]
    assert agg["count"] == 2
    total = sum(_nbytes(t) for t in made if isinstance(t, torch.Tensor))
    assert agg["devices"]["cpu"]["total_delta"] == total == 500 * 6
    assert "sent" in made


def test_plain_function_still_measured_and_bad_argument_still_refused() -> None:
    lord = MemLord()

    @lord.region("plain")
    def f() -> torch.Tensor:
        t = torch.empty(100, dtype=torch.uint8)
        lord.allocate(t)
        return t

    t = f()
    assert not inspect.isgeneratorfunction(f)
    assert lord.regions()["plain"]["devices"]["cpu"]["total_delta"] == _nbytes(t)
    with pytest.raises(TypeError, match="a decorator takes a function"):
        lord.region("x")(3)
