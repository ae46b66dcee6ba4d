"""vLLM's own routes beside the OpenAI ones: ``/health``, ``/ping``, ``/version``,
``/tokenize`` and ``/detokenize``, with vLLM's bodies.

``/health`` and ``/ping`` (SageMaker's name; GET or POST) answer 200 with an empty body
while the pool's Redis answers, 503 otherwise: vLLM's "the engine answers", for a pool
whose engines may be scaled to zero (``/readyz`` says whether workers are live).
``/tokenize`` and ``/detokenize`` use the tokenizer the workers publish
(``tokenizer.py``): 503 ``no_tokenizer`` before any worker of the pool has started.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Request, Response

from lorapool.bounds import TokenId, explain
from lorapool.connection import REDIS_DOWN
from lorapool.gateway.auth import Principal, require
from lorapool.gateway.body import read_json
from lorapool.gateway.json import JSON
from lorapool.gateway.tokenizer import PoolTokenizer
from lorapool.messages import check_messages, check_tools
from lorapool.openai.errors import APIError, bad_request
from lorapool.openai.params import chat_messages
from lorapool.protocol import FieldError, short_repr

router = APIRouter(tags=["vLLM"])
Caller = Annotated[Principal, Depends(require())]
MAX_TOKENS = 1 << 20  # token ids in one /detokenize
Tokens = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]


async def _health(request: Request) -> Response:
    try:
        await request.app.state.pool.view.ping()
    except REDIS_DOWN:
        return Response(status_code=503)
    return Response(status_code=200)


router.add_api_route("/health", _health, methods=["GET"], summary="200 while Redis answers")
router.add_api_route("/ping", _health, methods=["GET", "POST"], summary="as /health")


@router.get("/version", summary="The gateway's lorapool version")
async def version_route() -> JSON:
    try:
        number = version("lorapool")
    except PackageNotFoundError:
        number = "unknown"
    return JSON({"version": number})


@router.post("/tokenize", summary="Token ids of a prompt or a chat (vLLM's)")
async def tokenize(request: Request, caller: Caller) -> JSON:
    pool = request.app.state.pool
    body = await _body(request, caller)
    tokenizer = await _tokenizer(pool)
    wants_strs = _flag(body, "return_token_strs", False)
    if "messages" in body:
        text = _chat_text(body, tokenizer, pool.config.max_prompt_bytes)
        ids = tokenizer.encode(text, _flag(body, "add_special_tokens", False))
    elif isinstance(body.get("prompt"), str):
        ids = tokenizer.encode(body["prompt"], _flag(body, "add_special_tokens", True))
    else:
        raise bad_request(
            f"give a prompt (a string) or messages, got {short_repr(body.get('prompt'))}", "prompt"
        )
    limits = await pool.limits.get(pool.view)
    return JSON(
        {
            "count": len(ids),
            "max_model_len": limits.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.token_strs(ids) if wants_strs else None,
        }
    )


@router.post("/detokenize", summary="The text of token ids (vLLM's)")
async def detokenize(request: Request, caller: Caller) -> JSON:
    body = await _body(request, caller)
    try:
        tokens = msgspec.convert(body.get("tokens"), Tokens)
    except msgspec.ValidationError:
        raise bad_request(
            f"tokens must be a list of at most {MAX_TOKENS} token ids "
            f"({explain(TokenId)}), got {short_repr(body.get('tokens'))}",
            "tokens",
        ) from None
    tokenizer = await _tokenizer(request.app.state.pool)
    size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    outside = [t for t in tokens if t >= size]
    if outside:
        raise bad_request(
            f"tokens {short_repr(outside)} are outside the vocabulary of {size}", "tokens"
        )
    return JSON({"prompt": tokenizer.decode(tokens)})


async def _body(request: Request, caller: Principal) -> dict[str, Any]:
    pool = request.app.state.pool
    body = await read_json(request, pool.config.body_limit)
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {short_repr(body)}", None)
    if body.get("model") is not None:
        if not isinstance(body["model"], str):
            raise bad_request("model must be a string", "model")
        await pool.resolve_model(body["model"], caller)  # 404 for an unknown one
    return body


async def _tokenizer(pool) -> PoolTokenizer:
    tokenizer = await pool.tokenizers.get(pool.producer.redis, pool.producer.keys.tokenizer)
    if tokenizer is None:
        raise APIError(
            503,
            "no worker of this pool has published its tokenizer yet; start one",
            code="no_tokenizer",
        )
    return tokenizer


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {short_repr(value)}", name)
    return value


def _chat_text(body: dict[str, Any], tokenizer: PoolTokenizer, max_bytes: int) -> str:
    messages = chat_messages(body)
    try:
        messages = check_messages(messages, max_bytes)
        tools = check_tools(body.get("tools") or None, max_bytes, chat=True)
    except FieldError as exc:
        param = re.match(r"[a-z_]+", exc.field or "messages").group()  # "tools[0].type": tools
        raise bad_request(str(exc), param) from None
    try:
        return tokenizer.render(messages, tools, _flag(body, "add_generation_prompt", True))
    except Exception as exc:  # noqa: BLE001 - the template's own error names the problem
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
