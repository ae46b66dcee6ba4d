"""Multi-LoRA: loading PEFT adapters (safetensors only), the GPU/CPU slot manager and
the LoRA-wrapped layers that call ``lorapool.kernels``.

May import: torch, safetensors, ``lorapool.kernels`` and the engine's config.
"""
