"""The inference engine: model loading, forward pass, paged KV cache, scheduler,
sampler, LoRA manager and detokenizer, behind a vLLM-shaped ``LLM``/``LLMEngine``.

May import: torch, transformers (configs, tokenizers), safetensors and
``lorapool.kernels``; never redis or SQLAlchemy. The scheduler, block manager and
sequence bookkeeping are plain Python (checked by ``tests/unit/test_import_rules.py``).
"""
