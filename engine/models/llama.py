"""The Llama family: Llama 2/3, Mistral, SmolLM2, Qwen2 and Qwen3 in one module.

Module names follow the Hugging Face checkpoints (``model.layers.N.self_attn``…)
except that q/k/v are packed into ``qkv_proj`` and gate/up into
``gate_up_proj``. Shapes: T = tokens in the batch, D = hidden size,
Hq / Hkv = query / key-value heads, d = head size.

With ``fused`` (``EngineArgs.fused_layer_kernels``), where the Triton kernels run
(CUDA, or the CPU under ``TRITON_INTERPRET=1``), each layer runs the fused kernels:
the residual add folded into the next RMSNorm, RoPE (and Qwen3's q/k norms) into
the KV-cache write, SiLU into the multiply. Same numbers, at most 10 launches a
layer (tests/kernels/test_launch_count.py); the CPU reference path is unchanged.
"""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from lorapool import kernels
from lorapool.engine.batch import BatchMetadata
from lorapool.engine.models.args import ModelArgs
from lorapool.engine.models.layers import PackedLinear, RMSNorm, load_param
from lorapool.engine.models.rope import RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint projection name -> (packed module name, slice index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
UNPACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class LlamaAttention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads = args.num_heads, args.num_kv_heads
        self.head_dim = d = args.head_dim
        self.scale = d**-0.5
        sizes = [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]
        self.qkv_proj = PackedLinear(args.hidden_size, sizes, args.qkv_bias, dtype)
        self.o_proj = PackedLinear(self.num_heads * d, [args.hidden_size], args.o_bias, dtype)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: BatchMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        q, k, v = self._project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        kernels.write_kv_cache(k, v, *kv_cache, batch.slot_mapping)
        return self._attend(q, batch, kv_cache)

    def forward_fused(
        self, x: torch.Tensor, rope_tables, batch: BatchMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """``forward`` with the q/k norms and RoPE in the KV-cache write; ``rope_tables``:
        the (cos, sin) tables [P, d/2], indexed by ``batch.positions`` in the kernel."""
        q, k, v = self._project(x)
        qk_norm = None
        if self.q_norm is not None:  # one eps: both norms are built with rms_norm_eps
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = kernels.rotary_write_kv(
            q, k, v, *rope_tables, batch.positions, *kv_cache, batch.slot_mapping, qk_norm
        )
        return self._attend(q, batch, kv_cache)

    def _project(self, x: torch.Tensor):
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, d]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, d]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def _attend(self, q: torch.Tensor, batch: BatchMetadata, kv_cache: KVCache) -> torch.Tensor:
        num_tokens = q.shape[0]
        key_cache, value_cache = kv_cache
        out = kernels.paged_attention(
            q,
            key_cache,
            value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            self.scale,
            plan=batch.attention_plan,
        )
        return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = PackedLinear(args.hidden_size, [inter, inter], args.mlp_bias, dtype)
        self.down_proj = PackedLinear(inter, [args.hidden_size], args.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # views of a tensor of our own
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.self_attn = LlamaAttention(args, dtype)
        self.mlp = LlamaMLP(args, dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self, h: torch.Tensor, rope, batch: BatchMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, batch, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, h, residual, rope_tables, batch: BatchMetadata, kv_cache: KVCache):
        """``forward`` with the residual carried apart, each add fused into the norm after it.

        Takes the previous layer's MLP output ``h`` and its input ``residual`` (None at the
        first layer: ``h`` is the embedding); returns this layer's pair. ``residual`` is
        updated in place, so ``h + residual`` is always the unfused path's hidden state.
        """
        norm = self.input_layernorm
        if residual is None:
            residual, x = h, kernels.rms_norm(h, norm.weight, norm.eps)
        else:
            x = kernels.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn.forward_fused(x, rope_tables, batch, kv_cache)
        norm = self.post_attention_layernorm
        x = kernels.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(x), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.embed_tokens = nn.Embedding(
            args.vocab_size,
            args.hidden_size,
            dtype=dtype,
            _weight=torch.empty(args.vocab_size, args.hidden_size, dtype=dtype),
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, dtype) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(
            args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling, dtype
        )

    def forward(self, batch: BatchMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)  # [T, D]
        if self.fused and kernels.use_triton(h):
            return self._forward_fused(h, batch, kv_caches)
        rope = self.rotary_emb(batch.positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, rope, batch, kv_cache)
        return self.norm(h)

    def _forward_fused(self, h: torch.Tensor, batch: BatchMetadata, kv_caches) -> torch.Tensor:
        rope_tables = (self.rotary_emb.cos, self.rotary_emb.sin)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer.forward_fused(h, residual, rope_tables, batch, kv_cache)
        if residual is None:
            return kernels.rms_norm(h, self.norm.weight, self.norm.eps)
        return kernels.fused_add_rms_norm(h, residual, self.norm.weight, self.norm.eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder run over a packed batch with a paged KV cache.

    Build it with :func:`lorapool.engine.loader.load_model`; here the weights
    are uninitialised until :meth:`load_weights`.
    """

    def __init__(self, hf_config, dtype: torch.dtype = torch.float32, fused: bool = False):
        super().__init__()
        self.args = ModelArgs.from_hf_config(hf_config)
        self.model = LlamaModel(self.args, dtype, fused)
        self.lm_head = PackedLinear(self.args.hidden_size, [self.args.vocab_size], False, dtype)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """The shape of one layer's key cache, and of its value cache."""
        return (num_blocks, block_size, self.args.num_kv_heads, self.args.head_dim)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model can run (max_position_embeddings)."""
        return self.args.max_position_embeddings

    @torch.inference_mode()
    def forward(self, batch: BatchMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """Hidden states [T, hidden_size] of every token; writes the new tokens' K/V.

        ``kv_caches`` holds one (key_cache, value_cache) per layer, each
        [num_blocks, block_size, num_kv_heads, head_dim].
        """
        return self.model(batch, kv_caches)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab_size] in fp32 for hidden states [S, hidden_size], row-major
        (the sampler works along rows)."""
        return self.lm_head(hidden).float().contiguous()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors in; raise if any weight is left unset."""
        params = dict(self.named_parameters())
        loaded = {name for name, tensor in weights if self._load_one(params, name, tensor)}
        missing = sorted(set(self.checkpoint_names()) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {', '.join(missing[:4])}")

    def checkpoint_names(self) -> list[str]:
        """The Hugging Face names of every weight this model needs."""
        names = []
        for name, _ in self.named_parameters():
            *module_path, packed, param_name = name.split(".")
            parts = UNPACKED.get(packed, [packed])
            names += [".".join([*module_path, part, param_name]) for part in parts]
        return names

    def _load_one(self, params, hf_name: str, tensor: torch.Tensor) -> bool:
        if "rotary_emb" in hf_name:
            return False
        if hf_name == "lm_head.weight" and self.args.tie_word_embeddings:
            return False
        *module_path, proj, param_name = hf_name.split(".")
        if proj in PACKED_MODULES:
            packed, index = PACKED_MODULES[proj]
            module = self.get_submodule(".".join([*module_path, packed]))
            module.load_slice(param_name, index, tensor)
        elif hf_name in params:
            load_param(params[hf_name], tensor)
        else:
            raise ValueError(f"unexpected weight in checkpoint: {hf_name}")
        return True
