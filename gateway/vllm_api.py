"""vLLM's own routes beside the OpenAI ones: ``/health``, ``/ping``, ``/version``,
``/tokenize`` and ``/detokenize``, with vLLM's bodies.

``/health`` and ``/ping`` (SageMaker's name; GET or POST) answer 200 with an empty body
while the pool's Redis answers, 503 otherwise: vLLM's "the engine answers", for a pool
whose engines may be scaled to zero (``/readyz`` says whether workers are live).
``/tokenize`` and ``/detokenize`` use the tokenizer the workers publish
(``tokenizer.py``): 503 ``no_tokenizer`` before any worker of the pool has started.
Each call counts as one request against its key's rate limit (taken before the body is
read), a prompt or chat is bounded by ``max_prompt_bytes`` (413, as a job's), and the
template and the tokenizer run in the gateway's bounded pool (``heavy.py``), never on
the event loop.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import APIRouter, Request, Response

from lorapool.connection import REDIS_DOWN
from lorapool.gateway.auth import Principal, needs
from lorapool.gateway.body import read_struct
from lorapool.gateway.json import JSON
from lorapool.gateway.tokenizer import PoolTokenizer
from lorapool.openai.errors import APIError, bad_request
from lorapool.openai.params import chat_messages
from lorapool.protocol import FieldError, short_repr
from lorapool.records.bounds import TokenId
from lorapool.records.messages import check_messages, check_tools

router = APIRouter(tags=["vLLM"])
T = TypeVar("T", bound=msgspec.Struct)
Caller = Annotated[Principal, needs()]
MAX_TOKENS = 1 << 20  # token ids in one /detokenize
Tokens = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKENS)]


class TokenizeBody(msgspec.Struct):
    """vLLM's /tokenize body: a prompt, or a chat's messages (and tools). Fields of vLLM's
    this gateway does not use are ignored, as vLLM ignores fields it does not know."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(msgspec.Struct):
    """vLLM's /detokenize body."""

    tokens: Tokens
    model: str | None = None


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
    body = await _body(request, caller, TokenizeBody)
    tokenizer = await _tokenizer(pool)
    special = body.add_special_tokens
    if body.messages is not None:
        max_bytes = pool.config.max_prompt_bytes
        text = await pool.heavy.tokens(_chat_text, body, tokenizer, max_bytes)
        special = bool(special)  # the template has them: default off
    elif body.prompt is not None:
        text, special = body.prompt, special is not False
    else:
        raise bad_request("give a prompt (a string) or messages", "prompt")
    _check_size(text, pool.config.max_prompt_bytes)
    ids = await pool.heavy.tokens(tokenizer.encode, text, special)
    limits = await request.app.state.serving.pool_limits()
    strs = await pool.heavy.tokens(tokenizer.token_strs, ids) if body.return_token_strs else None
    return JSON(
        {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
         "token_strs": strs}
    )  # fmt: skip


def _check_size(text: str, max_bytes: int) -> None:
    """413 for a prompt no job could carry (its UTF-8 past ``max_prompt_bytes``)."""
    # within at 4 bytes a character, not measured; an ASCII str knows it is (a flag, no
    # pass), its length its size (encoding a 6 MB one to measure it took 1 ms)
    sized = len(text) * 4 <= max_bytes or text.isascii()
    size = len(text) if sized else len(text.encode("utf-8", "replace"))
    if size > max_bytes:
        raise APIError(
            413,
            f"the prompt is {size} bytes, over this pool's max_prompt_bytes ({max_bytes})",
            "prompt",
            code="prompt_too_large",
        )


@router.post("/detokenize", summary="The text of token ids (vLLM's)")
async def detokenize(request: Request, caller: Caller) -> JSON:
    pool = request.app.state.pool
    tokens = (await _body(request, caller, DetokenizeBody)).tokens
    tokenizer = await _tokenizer(pool)
    size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    outside = [t for t in tokens if t >= size]
    if outside:
        raise bad_request(
            f"tokens {short_repr(outside)} are outside the vocabulary of {size}", "tokens"
        )
    return JSON({"prompt": await pool.heavy.tokens(tokenizer.decode, tokens)})


async def _body(request: Request, caller: Principal, kind: type[T]) -> T:
    """The body (the call was taken from its key's requests per minute before any work,
    by ``auth.require``: a key over its limit gets its 429 without a byte parsed)."""
    pool = request.app.state.pool
    body = await read_struct(request, pool.config.body_limit, kind)
    if body.model is not None:
        await request.app.state.serving.resolve(body.model, caller)  # 404: an unknown one
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


def _chat_text(body: TokenizeBody, tokenizer: PoolTokenizer, max_bytes: int) -> str:
    messages = chat_messages({"messages": body.messages})
    try:
        messages = check_messages(messages, max_bytes)
        tools = check_tools(body.tools or None, max_bytes, chat=True)
    except FieldError as exc:
        param = re.match(r"[a-z_]+", exc.field or "messages").group()  # "tools[0].type": tools
        raise bad_request(str(exc), param) from None
    try:
        return tokenizer.render(messages, tools, body.add_generation_prompt is not False)
    except Exception as exc:  # noqa: BLE001 - the template's own error names the problem
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
