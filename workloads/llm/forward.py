"""The forward passes over the KV cache: a prompt chunk of one request, and one decode step of all slots.

Written here rather than calling ``LlamaForCausalLM.forward``: transformers' forward attends over its
own cache objects (one batch row per sequence, all of one length), while the engine keeps requests
in slots of one preallocated cache that they join and leave between steps (``kvcache.py``). The
layers' own modules and weights do the work (norms, projections, MLP, rotary embedding); only the
attention's reads and writes of the cache are ours.

Batch invariance (a request's tokens do not depend on which requests share its steps): a decode step
always runs all ``slots`` rows at one shape, attending over every position with a mask, so each
matmul and attention has the same shape whatever the batch holds, and rows never mix. A masked
position gets exactly zero weight, so what a free slot or an unused position holds never matters.
A prompt is prefilled alone, in chunks whose boundaries depend only on the prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .kvcache import KVCache
from .model import rotary_table


class Forward:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache) -> None:
        cfg = model.config
        self.model = model
        self.cache = cache
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.heads // self.kv_heads
        self.scale = self.head_dim**-0.5
        self.device = next(model.parameters()).device
        self.cos, self.sin = rotary_table(model, cache.positions)
        self.all_positions = torch.arange(cache.positions, device=self.device)

    def _layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        store: Callable[[torch.Tensor, torch.Tensor], None],
        read: Callable[[torch.Tensor], torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """All decoder layers over ``h`` [batch, T, hidden]. ``store(cache_view, new)`` writes the new keys (or values),
        laid out [batch, T, kv_heads, head_dim], into one layer's cache view; ``read(cache_view)`` picks the rows the
        queries attend over, laid out [batch, positions, kv_heads, head_dim]."""
        batch, steps, _ = h.shape
        group_mask = mask.repeat(1, 1, self.group, 1)  # [batch, 1, group * T, positions]: row j*T + t is query t
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(batch, steps, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(batch, steps, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(batch, steps, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = self.cache.layer(i, 0), self.cache.layer(i, 1)
            store(keys, k.transpose(1, 2))
            store(values, v)
            K, V = read(keys).transpose(1, 2), read(values).transpose(1, 2)  # [batch, kv_heads, positions, head_dim]
            # Grouped-query attention without repeating keys: the query heads that share a key head become
            # that head's rows (q head kv*group + j attends like HF's repeat_kv), so the kernel sees plain
            # multi-head attention over the cache's strided view and copies nothing.
            grouped = q.reshape(batch, self.kv_heads, self.group * steps, self.head_dim)
            out = F.scaled_dot_product_attention(grouped, K, V, attn_mask=group_mask, scale=self.scale)
            # reshape, not view: on CUDA the fused kernels may return the grouped rows strided (a prefill crashed so)
            out = out.reshape(batch, self.heads, steps, self.head_dim)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(batch, steps, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Run ``tokens`` (one request's, at positions start..) and write their keys/values into ``slot``.
        Returns the logits [vocab] (float32) after the last of them."""
        end = start + len(tokens)
        h = self.model.model.embed_tokens(torch.tensor([tokens], device=self.device))
        cos, sin = self.cos[start:end][None], self.sin[start:end][None]
        # Query at position p sees keys 0..p; the attention reads positions 0..end-1 of this slot.
        mask = (self.all_positions[None, :end] <= self.all_positions[start:end, None])[None, None]

        def store(view: torch.Tensor, new: torch.Tensor) -> None:
            view[slot, start:end] = new[0]

        h = self._layers(h, cos, sin, store, lambda view: view[slot : slot + 1, :end], mask)
        self.cache.note_written(slot, start, end)
        logits: torch.Tensor = self.model.lm_head(self.model.model.norm(h[:, -1]))
        return logits.float()[0]

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], active: list[int]) -> torch.Tensor:
        """One step of every slot: ``tokens[s]`` fed at ``positions[s]``; only the ``active`` slots' keys and values
        are written (a free slot's row is computed and dropped). Returns logits [slots, vocab] (float32)."""
        ids = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        rows = torch.tensor(active, device=self.device, dtype=torch.long)
        h = self.model.model.embed_tokens(ids[:, None])
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        # Every slot attends over all positions up to its own: one shape, whatever the batch holds.
        mask = (self.all_positions[None, :] <= pos[:, None])[:, None, None, :]
        rows_pos = pos[rows]

        def store(view: torch.Tensor, new: torch.Tensor) -> None:
            view[rows, rows_pos] = new[rows, 0]

        h = self._layers(h, cos, sin, store, lambda view: view, mask)
        for slot in active:
            self.cache.note_written(slot, positions[slot], positions[slot] + 1)
        logits: torch.Tensor = self.model.lm_head(self.model.model.norm(h[:, 0]))
        return logits.float()

    @torch.no_grad()
    def warm_up(self, slot: int, prompt: int) -> None:
        """A prompt chunk of ``prompt`` tokens and a decode step into ``slot``, their greedy picks brought to the host as
        the sampler brings them: a process's first passes load their kernels (on a GPU also set up cuBLAS and the
        attention's), so a restored target's first decode step, which every moved stream waits for, runs at speed."""
        self.prefill(slot, [0] * prompt, 0).argmax().item()
        positions = [0] * self.cache.slots
        positions[slot] = prompt
        self.decode([0] * self.cache.slots, positions, [slot]).argmax(dim=-1).tolist()
