"""OpenAI's API as the pool speaks it, for every door that takes OpenAI requests (the
HTTP gateway and the batch service): a request body to a job (its Struct in ``bodies``,
which parses it and is the gateway's OpenAPI schema of it; ``params``, with the
``structured`` outputs and ``tools`` parameters and the ``limits`` checked at the
door), a job's chunks and outputs to OpenAI's response and stream shapes (``format``,
``logprobs``, ``echo``, ``tool_stream``), and errors in OpenAI's shape (``errors``).
``serving`` strings these together for one request behind a small pool protocol
(``PoolAccess``: facts, no policy), used by the gateway's routes and by batch; the
policy it applies to the pool's facts (model names, rate limits, the backlog bound,
webhooks, a wait that ended without a result) is ``admission``'s.

May import: the standard library, orjson, msgspec and lorapool's torch-free modules
(bounds, protocol, messages, structured, tool_calls, egress, the lifecycle); never torch,
SQLAlchemy, a web framework, ``lorapool.gateway`` or ``lorapool.batch`` (the gateway turns an
``APIError`` into its HTTP answer: ``gateway.json.error_response``).
"""
