"""KEDA as it scales a ScaledObject of redis-streams triggers, computed against a real Redis.

What each trigger reads follows KEDA's redis-streams scaler (kedacore/keda,
pkg/scalers/redis_streams_scaler.go; keda.sh/docs/scalers/redis-streams): with a
``consumerGroup`` and ``lagCount`` (lag mode, Redis 7+) the group's ``lag`` from
XINFO GROUPS, XLEN while the group does not exist, 0 without the stream; with a
``consumerGroup`` and no ``lagCount`` (pending mode) the group's pending count
(XPENDING's summary), an error when the stream or the group does not exist; without
a ``consumerGroup``, XLEN. A trigger is active above its activation threshold
(``activationLagCount``, else 0) and wants ``ceil(value / target)`` replicas (an
AverageValue target); KEDA takes the largest trigger.

With ``spec.advanced.scalingModifiers`` (keda.sh/docs/reference/scaledobject-spec,
"scalingModifiers") the named triggers' values are composed by ``formula`` into one
metric: the ScaledObject is active when it is above ``activationTarget`` (default 0)
and wants ``ceil(metric / target)``; a trigger in error fails the whole metric.

``Loop`` is KEDA's loop around it (keda.sh/docs/concepts/scaling-deployments): every
``pollingInterval`` it reads the triggers; while active the HPA holds
``clamp(wanted, max(1, minReplicaCount), maxReplicaCount)``; once inactive for
``cooldownPeriod`` KEDA scales to ``minReplicaCount`` (0), and until then the HPA keeps
at least one replica.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

import redis


class TriggerError(Exception):
    """A trigger KEDA could not read (its scaler returned an error)."""


def trigger_value(client: redis.Redis, meta: dict) -> int:
    stream, group = meta["stream"], meta.get("consumerGroup")
    if group is None:
        return client.xlen(stream)
    if "lagCount" in meta:
        assert int(client.info("server")["redis_version"].split(".")[0]) >= 7
        if not client.exists(stream):
            return 0
        for info in client.xinfo_groups(stream):
            if info["name"].decode() == group:
                return info["lag"] or 0  # nil (unknown) reads as 0 in KEDA's client
        return client.xlen(stream)
    try:
        return client.xpending(stream, group)["pending"]
    except redis.ResponseError as exc:  # NOGROUP: no such stream or group
        raise TriggerError(f"XPENDING {stream} {group}: {exc}") from exc


def target_of(meta: dict) -> int:
    for key in ("lagCount", "pendingEntriesCount", "streamLength"):
        if key in meta:
            return int(meta[key])
    return 5  # the scaler's default


def activation_of(meta: dict) -> int:
    return int(meta.get("activationLagCount", "0")) if "lagCount" in meta else 0


def evaluate(formula: str, values: dict[str, float]) -> float:
    """``formula`` (expr's language; here its arithmetic on trigger names) over ``values``."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            left, right = walk(node.left), walk(node.right)
            return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[
                type(node.op)
            ]
        raise ValueError(f"formula {formula!r}: unsupported {ast.dump(node)}")

    return walk(ast.parse(formula, mode="eval"))


@dataclass
class Reading:
    active: bool
    wanted: int  # ceil(metric / target), before clamping
    values: dict[str, int]


def read(scaled: dict, client_of, streams_of=None) -> Reading:
    """One poll of the ScaledObject ``scaled``. ``client_of(trigger)``: a Redis client as
    the trigger's authentication; ``streams_of(stream)``: the streams a manifest's stream
    stands for (one per shard: the values are summed, as one trigger per shard would)."""
    spec = scaled["spec"]
    values, active, wanted = {}, False, 0
    for i, trigger in enumerate(spec["triggers"]):
        meta, client = trigger["metadata"], client_of(trigger)
        names = streams_of(meta["stream"]) if streams_of else [meta["stream"]]
        value = sum(trigger_value(client, {**meta, "stream": s}) for s in names)
        values[trigger.get("name", f"trigger{i}")] = value
        if value > activation_of(meta):
            active = True
        wanted = max(wanted, math.ceil(value / target_of(meta)))
    modifiers = spec.get("advanced", {}).get("scalingModifiers")
    if modifiers:
        metric = evaluate(modifiers["formula"], values)
        active = metric > float(modifiers.get("activationTarget", "0"))
        wanted = math.ceil(metric / float(modifiers["target"]))
    return Reading(active, wanted, values)


class Loop:
    """KEDA's scaling loop on a simulated clock: ``poll(client_of, streams_of)`` advances
    it one ``pollingInterval`` and returns the replicas KEDA and the HPA now want."""

    def __init__(self, scaled: dict, replicas: int = 0):
        spec = scaled["spec"]
        self.scaled = scaled
        self.min = spec.get("minReplicaCount", 0)
        self.max = spec.get("maxReplicaCount", 100)
        self.interval = spec.get("pollingInterval", 30)
        self.cooldown = spec.get("cooldownPeriod", 300)
        self.now, self.last_active, self.replicas = 0.0, None, replicas

    def poll(self, client_of, streams_of=None) -> int:
        self.now += self.interval
        reading = read(self.scaled, client_of, streams_of)
        floor = max(1, self.min)
        if reading.active:
            self.last_active = self.now
            self.replicas = min(max(reading.wanted, floor), self.max)
        elif self.replicas and (
            self.last_active is None or self.now - self.last_active >= self.cooldown
        ):
            self.replicas = self.min
        elif self.replicas:
            self.replicas = min(max(reading.wanted, floor), self.max)
        return self.replicas
