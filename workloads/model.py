"""The reference language model: a small decoder-only transformer with a byte-level tokenizer.

Everything is derived from ``(seed, size, dtype, device type)``, so two processes that build the
same model hold bit-identical weights and, with greedy decoding, give the same tokens for the same
prompt. No downloads: the tokenizer is the 256 byte values plus a few special tokens.

State-dict ordering (what the snapshot agent and the weights digest rely on): the order of
``model.state_dict()``, i.e. module definition order — ``tok_emb.weight``, ``pos_emb.weight``, then
for each block ``blocks.{i}.ln1.weight``, ``ln1.bias``, ``attn_qkv.weight``, ``attn_qkv.bias``,
``attn_out.weight``, ``attn_out.bias``, ``ln2.weight``, ``ln2.bias``, ``mlp_in.weight``,
``mlp_in.bias``, ``mlp_out.weight``, ``mlp_out.bias``, then ``ln_f.weight``, ``ln_f.bias``,
``lm_head.weight``. :func:`param_names` returns it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpumigrate.errors import InvalidInputError

BOS, EOS, PAD = 256, 257, 258
VOCAB = 260  # 256 bytes + BOS/EOS/PAD + one reserved id (keeps the vocabulary even)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq: int = 256
    vocab: int = VOCAB
    dropout: float = 0.0

    def n_params(self) -> int:
        d, f = self.d_model, self.d_ff
        per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return self.vocab * d + self.max_seq * d + self.n_layers * per_block + 2 * d + d * self.vocab


# Fixed presets. "tiny" is the CI/demo default: a few MB, a few ms per 8-token generation on CPU.
SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, n_layers=2, n_heads=4, d_ff=512),
    "small": ModelConfig(d_model=512, n_layers=6, n_heads=8, d_ff=2048),
}


def config_for(size: str, *, params_mb: float | None = None, dtype: str = "float32") -> ModelConfig:
    """The architecture for a preset name, or one scaled to about ``params_mb`` MB of weights."""
    if params_mb is not None:
        if params_mb <= 0:
            raise InvalidInputError(f"params_mb must be > 0, got {params_mb}")
        bytes_per = torch.tensor([], dtype=dtype_of(dtype)).element_size()
        target_params = params_mb * 1024 * 1024 / bytes_per
        d_model = 256 if target_params < 2e7 else 1024 if target_params < 2e9 else 4096
        per_block = 12 * d_model * d_model
        fixed = 2 * VOCAB * d_model + 256 * d_model
        n_layers = max(1, round((target_params - fixed) / per_block))
        return ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=d_model // 64, d_ff=4 * d_model)
    if size not in SIZES:
        raise InvalidInputError(f"unknown model size {size!r}; allowed: {', '.join(SIZES)} (or params_mb=N)")
    return SIZES[size]


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InvalidInputError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn_qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_out = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.mlp_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``cache`` holds the keys/values of earlier positions (incremental decoding); returns the new cache."""
        b, t, d = x.shape
        q, k, v = self.attn_qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        drop = self.dropout if self.training else 0.0
        # With a cache the query rows are the newest positions: they may see every cached key.
        att = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and t > 1, dropout_p=drop)
        x = x + F.dropout(self.attn_out(att.transpose(1, 2).reshape(b, t, d)), drop, self.training)
        x = x + F.dropout(self.mlp_out(F.gelu(self.mlp_in(self.ln2(x)))), drop, self.training)
        return x, (k, v)


class TinyLM(nn.Module):
    """Decoder-only transformer over bytes. ``forward(ids) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def layers(self) -> list[Block]:
        """The blocks as :class:`Block` objects (iterating the ModuleList gives plain Modules)."""
        return [b for b in self.blocks if isinstance(b, Block)]

    def forward(self, ids: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        return self.forward_cached(ids, None, last_only=last_only)[0]

    def forward_cached(
        self, ids: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]] | None, *, last_only: bool = False
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits for ``ids`` placed after the ``cache``'s positions, and the extended cache."""
        start = 0 if cache is None else cache[0][0].shape[2]
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i])
            new_cache.append(kv)
        x = self.ln_f(x)
        if last_only:  # generation needs only the next-token distribution: skip the other rows
            x = x[:, -1:, :]
        return self.lm_head(x), new_cache


def _init_parameters(model: TinyLM, seed: int, device: torch.device) -> None:
    """Deterministic init in state-dict order from one generator on ``device``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = (
                    0.02 / math.sqrt(2 * model.cfg.n_layers)
                    if name.endswith(("attn_out.weight", "mlp_out.weight"))
                    else 0.02
                )
                if p.dtype == torch.float32:
                    p.normal_(0.0, std, generator=gen)
                else:  # draw in float32 so the values do not depend on the sampling dtype's kernel
                    p.copy_(torch.empty(p.shape, device=device).normal_(0.0, std, generator=gen))


def build_model(
    seed: int = 0,
    size: str = "tiny",
    dtype: str = "float32",
    device: str = "cpu",
    *,
    params_mb: float | None = None,
    load_weights: bool = True,
    dropout: float = 0.0,
) -> TinyLM:
    """Build the model in eval mode on ``device``.

    ``load_weights=False`` allocates the tensors (zero-filled) without the seeded weights: a restore
    target holds the memory and waits for the snapshot agent to copy the real weights in.
    Weights depend on (seed, size/params_mb, dtype, device type): CPU and CUDA generators differ.
    """
    cfg = config_for(size, params_mb=params_mb, dtype=dtype)
    if dropout:
        cfg = ModelConfig(**{**asdict(cfg), "dropout": dropout})
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device cuda requested but CUDA is not available; allowed here: cpu")
    with torch.device("meta"):
        model = TinyLM(cfg).to(dtype_of(dtype))  # the dtype on the meta device: memory is taken once, in it
    model = model.to_empty(device=dev)
    if load_weights:
        _init_parameters(model, seed, dev)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model.eval()


def param_names(model: nn.Module) -> list[str]:
    """The fixed order of tensors: the state-dict order."""
    return list(model.state_dict().keys())


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a tensor (copied to CPU if needed), any dtype including bfloat16."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data.cast("B")


def weights_digest(model: nn.Module | dict[str, torch.Tensor]) -> str:
    """``blake3:<hex>`` (SHA-256 if blake3 is missing) over name, dtype, shape and bytes of each tensor, in state-dict order."""
    state = model.state_dict() if isinstance(model, nn.Module) else model
    try:
        import blake3

        h: Any = blake3.blake3()
        algo = "blake3"
    except ImportError:  # pragma: no cover - blake3 is a core dependency
        h, algo = hashlib.sha256(), "sha256"
    for name, t in state.items():
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}\n".encode())
        h.update(tensor_bytes(t))
    return f"{algo}:{h.hexdigest()}"


# ----------------------------------------------------------------------------- tokenizer + decoding


def encode(text: str) -> list[int]:
    return [BOS, *text.encode("utf-8")]


def decode(tokens: Iterable[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def _decode_weights(model: TinyLM) -> tuple[Any, ...]:
    """The tensors a decode step reads, gathered once per model (nn.Module attribute access is slow).

    Restores copy into these same tensors, so the gathered references stay valid; if the parameters
    themselves are replaced (``load_state_dict(assign=True)``, ``.to()``), the identity check on the
    first one rebuilds the tuple, and :func:`forget_decode_weights` forces it.
    """
    found: tuple[Any, ...] | None = model.__dict__.get("_decode_cache")
    if found is not None and found[0] is model.tok_emb.weight and found[-1] is model.lm_head.weight:
        return found
    layers = tuple(
        (b.ln1.weight, b.ln1.bias, b.attn_qkv.weight, b.attn_qkv.bias, b.attn_out.weight, b.attn_out.bias,
         b.ln2.weight, b.ln2.bias, b.mlp_in.weight, b.mlp_in.bias, b.mlp_out.weight, b.mlp_out.bias)
        for b in model.layers()
    )  # fmt: skip
    cached = (
        model.tok_emb.weight,
        model.pos_emb.weight,
        layers,
        model.ln_f.weight,
        model.ln_f.bias,
        model.lm_head.weight,
    )
    model.__dict__["_decode_cache"] = cached
    return cached


def forget_decode_weights(model: TinyLM) -> None:
    model.__dict__.pop("_decode_cache", None)


def _decode_step(
    model: TinyLM, token: torch.Tensor, pos: int, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Logits after one new token at position ``pos``, writing its key/value into the preallocated cache.

    The same math as ``forward_cached`` for one token (bit-identical results), with functional calls,
    gathered weights and no concatenation: less CPU per generated token, most of a tiny model's cost.
    """
    d, heads = model.cfg.d_model, model.cfg.n_heads
    tok_emb, pos_emb, layers, lnf_w, lnf_b, head = _decode_weights(model)
    x = (tok_emb[token] + pos_emb[pos]).view(1, 1, d)
    for i, (l1w, l1b, qkv_w, qkv_b, out_w, out_b, l2w, l2b, in_w, in_b, mo_w, mo_b) in enumerate(layers):
        qkv = F.linear(F.layer_norm(x, (d,), l1w, l1b), qkv_w, qkv_b).view(1, 1, 3, heads, d // heads)
        keys[i, :, :, pos] = qkv[:, 0, 1]
        values[i, :, :, pos] = qkv[:, 0, 2]
        att = F.scaled_dot_product_attention(
            qkv[:, :, 0].transpose(1, 2), keys[i, :, :, : pos + 1], values[i, :, :, : pos + 1]
        )
        x = x + F.linear(att.transpose(1, 2).reshape(1, 1, d), out_w, out_b)
        x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (d,), l2w, l2b), in_w, in_b)), mo_w, mo_b)
    return F.linear(F.layer_norm(x, (d,), lnf_w, lnf_b), head)[0, -1]


@torch.inference_mode()
def generate(
    model: TinyLM, prompt: str, max_new_tokens: int = 8, *, logit_noise: torch.Tensor | None = None
) -> tuple[list[int], list[float]]:
    """Greedy decoding. Returns the new tokens and the log-probability of each chosen token.

    The prompt keeps its last ``max_seq - max_new_tokens`` tokens so the window always fits.
    ``logit_noise`` (vocab-sized) is added to every step's logits: the drift fault uses it.
    The prompt is encoded once (``forward_cached``); each further token costs one :func:`_decode_step`.
    """
    device = next(model.parameters()).device
    ids = encode(prompt)[-(model.cfg.max_seq - max_new_tokens) :]
    logits, cache = model.forward_cached(torch.tensor([ids], dtype=torch.long, device=device), None, last_only=True)
    k0 = cache[0][0]
    n_prompt = len(ids)
    shape = (len(cache), k0.shape[0], k0.shape[1], n_prompt + max_new_tokens, k0.shape[3])
    keys = torch.empty(shape, dtype=k0.dtype, device=device)
    values = torch.empty(shape, dtype=k0.dtype, device=device)
    for i, (k, v) in enumerate(cache):
        keys[i, :, :, :n_prompt] = k
        values[i, :, :, :n_prompt] = v
    step_logits = logits[0, -1]
    chosen: list[torch.Tensor] = []
    chosen_lp: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        if step:
            step_logits = _decode_step(model, chosen[-1], n_prompt + step - 1, keys, values)
        lg = step_logits.float()
        if logit_noise is not None:
            lg = lg + logit_noise.to(lg.device)
        lp = torch.log_softmax(lg, dim=-1)
        nxt = torch.argmax(lp)
        chosen.append(nxt)
        chosen_lp.append(lp[nxt])
    # One conversion at the end instead of a Python round trip per step.
    return torch.stack(chosen).tolist(), torch.stack(chosen_lp).tolist()
