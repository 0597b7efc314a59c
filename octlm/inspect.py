"""Describe a model config without allocating its weights."""

from __future__ import annotations

import torch

from octlm.config import DecoderConfig
from octlm.model import Decoder


def describe(config: DecoderConfig, kv_dtype: torch.dtype) -> dict:
    """Fingerprint, parameter counts (from the config and from a meta-device model) and KV bytes/token."""
    with torch.device("meta"):
        model = Decoder(config)
    built = sum(p.numel() for p in model.parameters())
    return {
        "fingerprint": config.fingerprint(),
        "parameters": config.num_parameters(),
        "parameters_built": built,
        "kv_bytes_per_token": config.kv_bytes_per_token(torch.empty(0, dtype=kv_dtype).element_size()),
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
    }
