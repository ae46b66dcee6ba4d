"""A tenant's requests and tokens per minute, shared by every gateway and batch: GCRA.

The generic cell rate algorithm keeps one number per tenant and resource, its
theoretical arrival time (TAT), in ``{p}:rate:<tenant>:<requests|tokens>``. A limit
of L a minute lets each unit through 60/L seconds after the one before, with a burst
of up to L at once: a request costing c units is let through when ``TAT + c*60/L - 60``
is not in the future, and then moves TAT by ``c*60/L``. Unlike a fixed minute window,
there is no boundary at which 2L can pass in a moment (10 at :57 and 10 at :00 under
``--rpm 10``: the second 10 wait 6 s each). Both resources are taken together or not
at all, in one script on Redis's clock (every gateway and RQ worker agrees).

``RateState`` carries what OpenAI's ``x-ratelimit-*`` headers say: the limit, what is
left now, and how long until the bucket is full again; a refusal says how long to wait
(``Retry-After``). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lorapool.connection import register_script
from lorapool.lifecycle.keys import Keys

PERIOD_S = 60.0
# KEYS: the tenant's requests and tokens TAT. ARGV: requests limit, requests cost,
# tokens limit, tokens cost (a limit of 0: none), the period, and 1 to only look (a
# dry run: nothing taken, nothing written). Returns {taken (1/0: would be, dry),
# wait, requests left, requests reset, tokens left, tokens reset} (seconds as strings:
# Lua numbers come back as integers).
GCRA_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local period = tonumber(ARGV[5])
local taken, wait, state = 1, 0, {}
for i = 1, 2 do
  local limit, cost = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if limit > 0 then
    local interval = period / limit
    local tat = math.max(tonumber(redis.call('GET', KEYS[i]) or '0'), now)
    local after = tat + cost * interval
    if after - period > now then
      taken = 0
      wait = math.max(wait, after - period - now)
    end
    state[i] = {tat, after, interval}
  end
end
local out = {taken, string.format('%.6f', wait)}
for i = 1, 2 do
  local s = state[i]
  if s then
    local tat = s[1]
    if taken == 1 and ARGV[6] ~= '1' then
      tat = s[2]
      redis.call('SET', KEYS[i], string.format('%.6f', tat), 'PX',
                 math.ceil((tat - now) * 1000) + 1000)
    end
    out[#out + 1] = math.floor((period - (tat - now)) / s[3] + 1e-9)
    out[#out + 1] = string.format('%.6f', tat - now)
  else
    out[#out + 1] = -1
    out[#out + 1] = '0'
  end
end
return out
"""


@dataclass(frozen=True)
class RateState:
    """After one take: whether it was taken, how long to wait if not, and per resource
    (None without a limit) the limit, what is left and the seconds until full again."""

    taken: bool
    wait_s: float
    rpm: int | None
    tpm: int | None
    requests_left: int
    requests_reset_s: float
    tokens_left: int
    tokens_reset_s: float

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers (and ``Retry-After`` when refused)."""
        headers = {}
        for what, limit, left, reset in (
            ("requests", self.rpm, self.requests_left, self.requests_reset_s),
            ("tokens", self.tpm, self.tokens_left, self.tokens_reset_s),
        ):
            if limit is not None:
                headers[f"x-ratelimit-limit-{what}"] = str(limit)
                headers[f"x-ratelimit-remaining-{what}"] = str(max(0, left))
                headers[f"x-ratelimit-reset-{what}"] = duration(reset)
        if not self.taken:
            headers["Retry-After"] = str(max(1, math.ceil(self.wait_s)))
        return headers


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


def _args(keys: Keys, tenant: str, rpm, tpm, requests: int, tokens: int, dry: bool) -> dict:
    return {
        "keys": [keys.rate(tenant, "requests"), keys.rate(tenant, "tokens")],
        "args": [rpm or 0, requests, tpm or 0, tokens, PERIOD_S, int(dry)],
    }


def _state(reply: list, rpm, tpm) -> RateState:
    taken, wait, r_left, r_reset, t_left, t_reset = reply
    return RateState(
        bool(int(taken)), float(wait), rpm, tpm,
        int(r_left), float(r_reset), int(t_left), float(t_reset),
    )  # fmt: skip


class RateLimiter:
    """Takes requests and tokens from tenants' limits (a sync or asyncio client: with
    an asyncio one, ``take`` is awaited)."""

    def __init__(self, connection, keys: Keys):
        self.keys = keys
        self._script = register_script(connection, GCRA_SCRIPT)

    def take(self, tenant: str, rpm, tpm, requests: int, tokens: int, dry: bool = False):
        """Take ``requests`` and ``tokens`` from ``tenant``'s limits (None: unlimited)
        if both allow it: a RateState (awaitable with an asyncio client). ``dry``: only
        whether they would be taken, and the state as it stands."""
        reply = self._script(**_args(self.keys, tenant, rpm, tpm, requests, tokens, dry))
        if hasattr(reply, "__await__"):

            async def state() -> RateState:
                return _state(await reply, rpm, tpm)

            return state()
        return _state(reply, rpm, tpm)
