"""The LLM server's model: a transformers ``LlamaForCausalLM`` with weights derived from a seed.

No download: the configuration is built here (``CONFIGS``) and every weight is drawn from one
``torch.Generator`` on the target device, in state-dict order, so two processes on machines of one
kind build bit-identical models (CPU and CUDA generators differ, so a CPU model and a CUDA model of
one seed differ). Norm weights are ones, as transformers initialises them.

The tokenizer is byte-level (ids 0-255 are the UTF-8 bytes, then BOS, EOS, PAD and one reserved id):
nothing to download, every string encodes, and a token boundary can fall inside a character (the
engine decodes incrementally; see ``requests.py``).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

BOS, EOS, PAD, RESERVED = 256, 257, 258, 259
VOCAB = 260
NEVER_SAMPLED = (BOS, PAD, RESERVED)  # ids a generation never emits (EOS ends it)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """One model size: the LlamaConfig fields that differ, and the server's defaults for it."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    slots: int  # requests decoded together (the running batch's fixed width)
    max_context: int  # positions per slot: prompt + generated tokens


CONFIGS = {
    # CPU and CI: 8 streams of 200 tokens in seconds on 2 cores.
    "tiny": Shape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, slots=8, max_context=512),
    # The GPU benchmark: ~1.09 B parameters (bf16 ~2.2 GB), grouped-query attention 32/8.
    "1b": Shape(hidden=2048, layers=18, heads=32, kv_heads=8, intermediate=8192, slots=64, max_context=4608),
}


def llama_config(size: str, max_context: int | None = None) -> LlamaConfig:
    if size not in CONFIGS:
        raise ValueError(f"size {size!r}: one of {', '.join(CONFIGS)}")
    s = CONFIGS[size]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=max_context or s.max_context,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )


def build_model(
    seed: int, size: str = "tiny", dtype: str = "float32", device: str = "cpu", *, load_weights: bool = True
) -> LlamaForCausalLM:
    """The model in eval mode. ``load_weights=False``: allocated and zero-filled (a target that waits for a restore)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    config = llama_config(size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    torch.nn.Module.to(model, dtype=DTYPES[dtype])  # (transformers' own .to() is typed for its quantizers)
    model = model.to_empty(device=device)
    # Weights from one seeded generator on the device, in state-dict order: no global RNG, no download.
    gen = torch.Generator(device=device).manual_seed(seed)
    std = config.initializer_range
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not load_weights:
                tensor.zero_()
            elif name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, std, generator=gen)
        # Non-persistent buffers (the rotary frequencies) came out of to_empty() uninitialised: rebuild.
        model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    torch.nn.Module.eval(model)
    return model


def rotary_table(model: LlamaForCausalLM, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..positions-1 ([positions, head_dim], the model's dtype), from its rotary module."""
    param = next(model.parameters())
    ids = torch.arange(positions, device=param.device)[None]
    cos, sin = model.model.rotary_emb(torch.empty(0, device=param.device, dtype=param.dtype), ids)
    return cos[0], sin[0]


def encode(text: str) -> list[int]:
    """BOS then the text's UTF-8 bytes."""
    return [BOS, *text.encode("utf-8")]


def new_decoder() -> codecs.IncrementalDecoder:
    """A UTF-8 decoder fed one token at a time; invalid bytes become U+FFFD, as in the non-streamed text."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def model_id(size: str, dtype: str, seed: int) -> str:
    return f"llama-{size}-{dtype}-s{seed}"
