"""What a request must pass before its jobs are submitted, and what a wait for them that
ended without a result says, in OpenAI's error shape: the policy that
``OpenAIServing`` applies to the facts its pool gives (``serving.PoolAccess``: the
base model, a registry record, the backlog, a tenant's rate windows, webhook secrets).

- a model name that no adapter can have: 400 on ``model`` (a NUL, over 1,024
  characters) or 404 ``model_not_found``;
- a tenant's requests and tokens per minute: 400 for a request that could never fit
  (waiting would not help, so no Retry-After invites a retry), 429 with Retry-After and
  OpenAI's ``x-ratelimit-*`` headers past them;
- the pool's backlog at its bound: 429 ``backlog_full``;
- a webhook URL that will not be called: 400 on ``on_finish``;
- a wait that ended without a result: 503 ``no_worker``, 503 ``job_lost``, 504.
"""

from __future__ import annotations

import asyncio

from lorapool.egress import EgressError, EgressPolicy, EgressRefused, check_url, system_resolver
from lorapool.lifecycle.marker import JobLost, NoWorker, RedisAway
from lorapool.lifecycle.rate_limits import RateState
from lorapool.openai.errors import APIError, job_lost, model_not_found
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import NAME_PATTERN

RESOLVE_S = 2.0  # a webhook host's resolution at submit, at most


def check_model_name(model: str) -> None:
    """400 for a ``model`` no name can be, 404 for one no adapter can have."""
    if NAME_PATTERN.fullmatch(model):
        return
    if "\x00" in model or len(model) > 1024:
        raise APIError(400, "model must be a model or adapter name", "model")
    raise model_not_found(model)


def rate_cost(caller, requests: int, params: SamplingParams | None) -> int:
    """The tokens a submit of ``requests`` prompts takes from ``caller``'s minute (the
    most it may generate, max_tokens x n a prompt; ``params`` None: a request that
    generates nothing, a file upload say); 400 for one that could never fit."""
    if caller.rpm is not None and requests > caller.rpm:
        raise APIError(
            400,
            f"this request is {requests} requests (one a prompt), over this key's "
            f"{caller.rpm} requests per minute: it can never fit; send at most "
            f"{caller.rpm} prompts a request",
            "prompt",
            code="exceeds_rate_limit",
        )
    if params is None:
        return 0
    if caller.tpm is not None and params.max_tokens is None:
        raise APIError(400, "max_tokens is required under a token rate limit", "max_tokens")
    tokens = requests * params.n * (params.max_tokens or 0)
    if caller.tpm is not None and tokens > caller.tpm:
        raise APIError(
            400,
            f"this request may generate {tokens} tokens (max_tokens x n x prompts), over "
            f"this key's {caller.tpm} tokens per minute",
            "max_tokens",
        )
    return tokens


def rate_refused(caller, state: RateState) -> APIError:
    """429 for a submit its tenant's rate windows did not take."""
    return APIError(
        429,
        f"tenant {caller.tenant!r} is over its rate limit "
        f"({caller.rpm or '-'} requests, {caller.tpm or '-'} tokens a minute); "
        f"retry in {state.wait_s:.1f}s",
        code="rate_limit_exceeded",
        headers=state.headers(),
    )


def backlog_full(bound: int, retry_after_s: int) -> APIError:
    """429 with Retry-After while ``bound`` entries wait for a worker: a pool whose
    workers are stopped or saturated refuses work instead of piling it up."""
    return APIError(
        429,
        f"the pool's backlog is at its bound ({bound} waiting jobs); retry later",
        code="backlog_full",
        headers={"Retry-After": str(retry_after_s)},
    )


async def check_webhook_url(url: str, allow: tuple[str, ...]) -> None:
    """400 naming ``on_finish`` for a URL that resolves to an internal address outside
    ``allow`` or does not resolve (in ``RESOLVE_S``). The sender checks again at each
    attempt (a name may resolve elsewhere by then)."""
    policy = EgressPolicy(allow)
    try:
        await asyncio.wait_for(
            asyncio.to_thread(check_url, url, policy, system_resolver, RESOLVE_S),
            RESOLVE_S + 0.5,
        )
    except (EgressRefused, EgressError, asyncio.TimeoutError) as exc:
        reason = str(exc) or f"resolving took over {RESOLVE_S:g}s"
        raise APIError(400, f"on_finish: {reason}", "on_finish", "invalid_url") from None


def no_webhook_secret(tenant: str | None) -> APIError:
    """400 on ``on_finish`` when the tenant has no secret to sign deliveries with."""
    who = f"tenant {tenant!r}" if tenant else "this pool"
    return APIError(
        400,
        f"on_finish: {who} has no webhook secret to sign deliveries with; "
        "the operator makes one with: lorapool keys webhook-secret " + (tenant or ""),
        "on_finish",
    )


def wait_error(exc: Exception, caller, retry_after_s: int, timeout_s: float) -> APIError:
    """The reply to a wait for jobs that ended with ``exc`` (the pool's: ``NoWorker``,
    ``JobLost``, ``RedisAway``, TimeoutError after ``timeout_s``), naming jobs as
    ``caller`` knows them."""
    if isinstance(exc, RedisAway):
        return redis_unavailable(exc)
    if isinstance(exc, NoWorker):
        ids = ", ".join(caller.external_id(rid) for rid in exc.request_ids)
        return APIError(
            503,
            f"no worker took the request within {exc.waited_s:g}s; "
            f"it stays queued as job {ids} (GET /v1/jobs/{{id}})",
            code="no_worker",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, JobLost):
        return job_lost(caller.external_id(exc.request_id))
    return APIError(504, f"no result within {timeout_s:g}s; the request was aborted")


def redis_unavailable(exc: RedisAway) -> APIError:
    """503 ``redis_unavailable``: Redis away (the gateway's watch), with Retry-After."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    return APIError(503, str(exc), code="redis_unavailable", headers=headers)


def client_gone() -> APIError:
    """499: the client left before its reply; its jobs were aborted."""
    return APIError(499, "the client closed the request; its jobs were aborted")
