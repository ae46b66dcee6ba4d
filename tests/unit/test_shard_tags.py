"""Shard hash tags spread a sharded pool over every master: shard s's slot lies in the
s-th N-th of the slot space, the ranges ``redis-cli --cluster create`` gives N masters."""

import pytest
from redis.crc import key_slot

from lorapool.lifecycle.keys import SLOTS, Keys, shard_tag, tag_slot


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5, 7, 16, 64, 1024])
def test_each_shard_lies_in_its_nth_of_the_slots(shards):
    for s in range(shards) if shards <= 64 else (0, 1, 511, 1023):
        slot = key_slot(shard_tag("lorapool", s, shards).encode())
        assert s * SLOTS // shards <= slot < (s + 1) * SLOTS // shards, (s, slot)


def test_every_key_of_a_shard_carries_its_tag():
    keys = Keys("pool", 3)
    tags = {s: "{" + shard_tag("pool", s, 3) + "}" for s in range(3)}
    for s, view in enumerate(keys.shard_views):
        for name in (view.requests, view.batch_requests, view.dead, view.audit, view.handoff("w")):
            assert name.startswith(tags[s] + ":")
    for rid in ("a", "b", "req-17", "日本"):
        tag = tags[keys.shard_of(rid)]
        assert {key_slot(k.encode()) for k in (keys.job(rid), keys.out(rid), keys.abort(rid))} == {
            key_slot(tag.encode())
        }
    assert keys.model == "{pool}:model"  # the pool's own keys keep the meta tag
    assert Keys("pool").requests == "pool:requests"  # and an unsharded pool its names


def test_the_slot_is_redis_own():
    for tag in ("lorapool:0-11", "x", "日本", "pool:3-0"):  # what Redis hashes of a key
        assert tag_slot(tag) == key_slot(("{" + tag + "}:requests").encode())


def test_three_shards_on_three_masters_of_redis_cli_ranges():
    """redis-cli --cluster create on 3 masters: 0-5460, 5461-10922, 10923-16383."""
    ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
    masters = set()
    for s in range(3):
        slot = key_slot(shard_tag("lorapool", s, 3).encode())
        masters |= {i for i, (lo, hi) in enumerate(ranges) if lo <= slot <= hi}
    assert masters == {0, 1, 2}
