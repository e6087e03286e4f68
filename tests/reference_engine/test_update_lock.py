"""The engine's update lock (sglang's model_update_lock): writers first, and a writer that
gives up while waiting must not leave requests queued behind it."""

from __future__ import annotations

import asyncio

from slime_like.reference_engine.frontend import RWLock


def test_a_writer_cancelled_while_waiting_lets_the_queued_readers_in():
    async def scenario() -> list[str]:
        lock, order = RWLock(), []
        holding = asyncio.Event()
        release = asyncio.Event()

        async def generate(name: str, wait: asyncio.Event | None = None) -> None:
            async with lock.reader():
                order.append(name)
                if wait is not None:
                    holding.set()
                    await wait.wait()

        async def update() -> None:
            async with lock.writer():
                order.append("update")

        first = asyncio.create_task(generate("running", release))
        await holding.wait()
        writer = asyncio.create_task(update())  # waits for the running request
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(generate("queued"))  # held back: a writer waits
        await asyncio.sleep(0.01)
        assert order == ["running"]
        writer.cancel()  # e.g. the update's handler is cancelled
        await asyncio.wait_for(queued, timeout=5)  # let in without the first one finishing
        release.set()
        await first
        return order

    assert asyncio.run(scenario()) == ["running", "queued"]


def test_an_update_waits_for_running_requests_and_holds_back_new_ones():
    async def scenario() -> list[str]:
        lock, order = RWLock(), []
        release = asyncio.Event()

        async def generate(name: str, wait: asyncio.Event | None = None) -> None:
            async with lock.reader():
                order.append(name)
                if wait is not None:
                    await wait.wait()

        async def update() -> None:
            async with lock.writer():
                order.append("update")

        first = asyncio.create_task(generate("running", release))
        await asyncio.sleep(0.01)
        writer = asyncio.create_task(update())
        await asyncio.sleep(0.01)
        later = asyncio.create_task(generate("later"))
        await asyncio.sleep(0.01)
        assert order == ["running"]
        release.set()
        await asyncio.gather(first, writer, later)
        return order

    assert asyncio.run(scenario()) == ["running", "update", "later"]
