"""``gateway/turns.py``'s turns, against a model of what they promise: per tenant at most
``per_tenant`` held, none idle while its requests wait (work-conserving), handed out in
arrival order, a cancelled waiter skipped (and a turn handed to one as it was cancelled
passed on), nothing left over once every turn has ended; other tenants never wait."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.gateway.turns import Turns

TENANTS = ("acme", "globex", "initech")
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.sampled_from(TENANTS)),
        st.tuples(st.just("end"), st.integers(0, 30)),
        st.tuples(st.just("cancel"), st.integers(0, 30)),
        st.tuples(st.just("end_cancel"), st.integers(0, 30)),
    ),
    max_size=60,
)


async def _run(per_tenant: int, ops) -> None:
    turns = Turns(per_tenant, pace=False)
    tasks: list[tuple[str, asyncio.Task]] = []  # in arrival order
    ended: set[int] = set()

    async def settle():
        for _ in range(5):
            await asyncio.sleep(0)

    for op, arg in ops:
        if op == "take":
            tasks.append((arg, asyncio.ensure_future(turns.take(arg))))
        else:
            live = [i for i, (_, t) in enumerate(tasks) if i not in ended and not t.cancelled()]
            if not live:
                continue
            i = live[arg % len(live)]
            task = tasks[i][1]
            if op in ("end", "end_cancel") and task.done():
                task.result().end()
                task.result().end()  # a second end gives nothing back
                ended.add(i)
                if op == "end_cancel":  # the next waiter goes as its turn is handed over
                    tenant = tasks[i][0]
                    nxt = [t for n, t in tasks if n == tenant and not t.done()]
                    if nxt:
                        nxt[0].cancel()
            elif op == "cancel" and not task.done():
                task.cancel()
        await settle()
        for tenant in TENANTS:
            mine = [(i, t) for i, (n, t) in enumerate(tasks) if n == tenant and not t.cancelled()]
            held = [i for i, t in mine if t.done() and i not in ended]
            waiting = [i for i, t in mine if not t.done()]
            assert len(held) <= per_tenant
            assert not waiting or len(held) == per_tenant  # no turn idle while one waits
            granted = [i for i, t in mine if t.done()]
            assert not waiting or max(granted, default=-1) < min(waiting)  # in order
    for _, task in tasks:
        if not task.done():
            task.cancel()
    await settle()
    for i, (_, task) in enumerate(tasks):
        if i not in ended and task.done() and not task.cancelled():
            task.result().end()
    assert turns.busy == {} and turns.waiting == {}


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), OPS)
def test_turns_hold_their_promises_under_any_interleaving(per_tenant, ops):
    asyncio.run(_run(per_tenant, ops))


def test_another_tenants_request_never_waits_for_a_flooding_one():
    async def run():
        turns = Turns(1)
        first = await turns.take("acme")
        flood = [asyncio.ensure_future(turns.take("acme")) for _ in range(100)]
        await asyncio.sleep(0)
        other = await asyncio.wait_for(turns.take("globex"), 0.1)
        assert not any(t.done() for t in flood)
        other.end()
        first.end()
        for task in flood:
            (await task).end()
        assert turns.busy == {} and turns.waiting == {}

    asyncio.run(run())


def test_no_tenant_or_no_turns_takes_nothing():
    async def run():
        for turns, tenant in ((Turns(0), "acme"), (Turns(1), None)):
            held = [await turns.take(tenant) for _ in range(5)]
            assert turns.busy == {}
            for turn in held:
                turn.end()

    asyncio.run(run())


def test_a_tenant_beside_an_active_one_is_paced_by_its_turns_length():
    """Its next turn, queued or sent after, waits its last turn's length times the other
    active tenants' count; alone, or with the others gone quiet, it is not paced."""

    async def held_then_next(turns, queued: bool) -> float:
        loop = asyncio.get_running_loop()
        first = await turns.take("acme")
        nxt = asyncio.ensure_future(turns.take("acme")) if queued else None
        await asyncio.sleep(0.2)
        first.end()
        began = loop.time()
        turn = await (nxt if queued else turns.take("acme"))
        turn.end()
        return loop.time() - began

    async def run():
        turns = Turns(1)
        assert await held_then_next(turns, queued=True) < 0.05  # alone
        for name in ("acme", "globex", "initech"):
            turns.saw(name)  # their keys checked: two others active
        assert 0.35 < await held_then_next(turns, queued=True) < 0.8
        for name in ("acme", "globex", "initech"):
            turns.saw(name)
        for made_up in range(50):  # keys no one has: not active, and no pause from them
            (await turns.take(f"lp_{made_up}")).end()
        assert 0.35 < await held_then_next(turns, queued=False) < 0.8
        turns.seen = {"acme": asyncio.get_running_loop().time()}  # the others went quiet
        assert await held_then_next(turns, queued=False) < 0.05
        assert turns.busy == {} and turns.waiting == {}

    asyncio.run(run())


def test_a_pause_is_at_most_a_second_whatever_the_turns_length_and_the_others():
    """A turn's length counts its waits too (a body sent slowly, a compile): a key that
    held one 30 s beside 100 active keys waits a second, not 50 minutes."""

    async def run():
        turns = Turns(1)
        for name in range(100):
            turns.saw(f"k{name}")
        turns.saw("acme")
        first = await turns.take("acme")
        first._since -= 30.0  # held 30 s
        first.end()
        loop = asyncio.get_running_loop()
        began = loop.time()
        (await turns.take("acme")).end()
        assert 0.8 < loop.time() - began < 1.5

    asyncio.run(run())
