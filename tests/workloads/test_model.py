"""The model is a pure function of (seed, size, dtype, device type)."""

from __future__ import annotations

import pytest
import torch

from gpumigrate.errors import InvalidInputError
from gpumigrate.workloads.model import (
    VOCAB,
    build_model,
    config_for,
    decode,
    encode,
    generate,
    param_names,
    weights_digest,
)


def test_same_seed_same_weights_and_outputs() -> None:
    a, b = build_model(0, "tiny"), build_model(0, "tiny")
    assert weights_digest(a) == weights_digest(b)
    assert generate(a, "hello", 8) == generate(b, "hello", 8)


def test_different_seed_different_weights() -> None:
    assert weights_digest(build_model(0, "tiny")) != weights_digest(build_model(1, "tiny"))


def test_kv_cache_decoding_matches_full_recompute() -> None:
    model = build_model(3, "tiny")
    tokens, logprobs = generate(model, "The quick brown fox", 6)
    ids = torch.tensor([encode("The quick brown fox")])
    with torch.inference_mode():
        for tok, lp in zip(tokens, logprobs, strict=True):
            full = torch.log_softmax(model(ids)[0, -1], dim=-1)
            assert int(full.argmax()) == tok
            assert abs(float(full[tok]) - lp) < 1e-4
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)


def test_state_dict_order_is_module_order() -> None:
    names = param_names(build_model(0, "tiny"))
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert names[2] == "blocks.0.ln1.weight"
    assert names[-1] == "lm_head.weight"


def test_unloaded_model_is_allocated_and_zero() -> None:
    model = build_model(0, "tiny", load_weights=False)
    assert all(not p.any() for p in model.parameters())
    assert weights_digest(model) != weights_digest(build_model(0, "tiny"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_build_and_digest(dtype: str) -> None:
    a, b = build_model(0, "tiny", dtype=dtype), build_model(0, "tiny", dtype=dtype)
    assert next(a.parameters()).dtype == getattr(torch, dtype)
    assert weights_digest(a) == weights_digest(b)


def test_params_mb_scales_the_model() -> None:
    cfg = config_for("tiny", params_mb=20)
    mb = cfg.n_params() * 4 / 2**20
    assert 10 < mb < 30
    assert config_for("tiny", params_mb=20, dtype="bfloat16").n_params() > cfg.n_params()


def test_bad_size_and_dtype_name_what_is_allowed() -> None:
    with pytest.raises(InvalidInputError, match="tiny"):
        build_model(0, "huge")
    with pytest.raises(InvalidInputError, match="float32"):
        build_model(0, "tiny", dtype="int8")


def test_tokenizer_round_trip() -> None:
    ids = encode("héllo")
    assert ids[0] == 256 and max(ids) < VOCAB
    assert decode(ids) == "héllo"
