"""Random-weight Qwen3 snapshots written by transformers, the reference for octlm's loader tests.

transformers is a reference here: these helpers build the files, octlm must read them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from octlm.safetensors import SafetensorsFile, write_safetensors

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # 4 heads x 32 = 128 != 64: rectangular q/o projections, as in Qwen3
    intermediate_size=96,
    max_position_embeddings=512,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def random_qwen(seed: int = 0, **overrides):
    """A transformers Qwen3ForCausalLM whose every weight, norms included, is random and distinct."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**(TINY | overrides)))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norm gains: away from 1 so a swapped or skipped norm shows
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:  # large enough that blocks, not each token's own embedding, pick the next token
                param.normal_(0.0, 0.3)
    return model.eval()


def save_snapshot(model, directory: Path, tokenizer_dir: Path | None = None, **save_kwargs) -> Path:
    """save_pretrained into `directory`, with the real tokenizer files beside it when given."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **save_kwargs)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def add_duplicate_head(directory: Path, change: bool = False) -> Path:
    """Rewrite model.safetensors with lm_head.weight stored beside the tied embeddings (like the real file).

    With `change`, the stored head differs from the embeddings in one element.
    """
    path = directory / "model.safetensors"
    with SafetensorsFile(path) as file:
        tensors = dict(file.tensors())
        metadata = file.metadata
    head = tensors["model.embed_tokens.weight"].clone()
    if change:
        head[3, 5] += 1.0
    tensors["lm_head.weight"] = head
    write_safetensors(path, tensors, metadata)
    return directory


def rewrite_weights(directory: Path, edit) -> Path:
    """Apply `edit(dict of tensors) -> dict` to a single-file snapshot's weights, in place."""
    path = directory / "model.safetensors"
    with SafetensorsFile(path) as file:
        tensors = dict(file.tensors())
        metadata = file.metadata
    write_safetensors(path, edit(tensors), metadata)
    return directory
