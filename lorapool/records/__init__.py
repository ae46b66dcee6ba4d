"""Every record that crosses Redis or HTTP, one noun a file: the floor of the house.

- ``params``: ``SamplingParams``, ``LoRARequest``, ``RequestOutputKind`` (public face:
  ``lorapool.protocol``);
- ``outputs``: ``RequestOutput``, ``CompletionOutput``, ``RequestMetrics``, ``Logprob``
  (public face: ``lorapool.outputs``);
- ``bounds``: the bound of every field, as msgspec constraint types;
- ``errors``: ``FieldError`` and the one translation of msgspec's errors into a field path;
- ``error_kind``: what failed a request, carried in its final chunk;
- ``messages``, ``structured``: a chat's messages and tools; structured-output params;
- ``job``: a job on ``{p}:requests``; ``chunk`` (+ ``accumulator``): a request's chunk
  log on ``{p}:out:<id>`` and the output kept from it;
- ``marker``: a job's marker (``{p}:job:<id>``, producer-writable) and run
  (``{p}:run:<id>``, workers' alone), with ``JobStatus``;
- ``adapter``: an adapter's registry record and the base model's ``ModelIdentity``;
- ``audit``: the signed audit record; ``dead_letter``; ``heartbeat``; ``api_key``.

Which room a change belongs in: a field, a bound, a status or a record's encoding is
here; what is done to Redis with it (keys, Lua scripts, readers) is ``lifecycle``; who
does it when is ``worker``, ``producer`` (the client SDK) or ``gateway`` (HTTP).

May import: the standard library, orjson, msgspec and lorapool's torch-free root modules
(``signing``, ``adapter_config``, ``identity``). Never redis, ``lifecycle``, ``gateway``,
``worker``, ``engine``, ``openai`` or ``producer`` (tests/unit/test_architecture.py).
"""
