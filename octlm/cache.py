"""A preallocated key/value cache that knows its own length."""

from __future__ import annotations

import torch

from octlm.config import DecoderConfig


class KVCache:
    """Keys and values of every layer, stored before any grouped-query head repetition.

    Buffers are (n_layers, batch, kv_heads, max_len, head_dim). The Decoder writes a step's keys and
    values at [length, length + T) in every layer, then calls `advance(T)` once: the cache never
    guesses when a step ends.

    Rows of a batch may start with left padding: `valid` (batch, max_len) then marks real tokens and
    `row_lengths` (batch,) counts them, which gives each row its own RoPE positions.
    """

    def __init__(
        self,
        config: DecoderConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_len <= 0:
            raise ValueError(f"KVCache max_len must be positive, got {max_len}")
        if max_len > config.context_length:
            raise ValueError(
                f"KVCache max_len {max_len} exceeds the model's context of {config.context_length}"
            )
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.dim_per_head)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.valid: torch.Tensor | None = None
        self.row_lengths: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one row takes, over all layers, keys and values."""
        return self.nbytes // (self.max_len * self.batch_size)

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise ValueError(
                f"KVCache holds {self.length} of {self.max_len} positions; {new_tokens} more do not fit"
            )

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, kv_heads, T, hd) keys/values at the current length; return everything so far."""
        end = self.length + keys.shape[2]
        self.keys[layer, :, :, self.length : end] = keys
        self.values[layer, :, :, self.length : end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def positions(self, valid: torch.Tensor | None, new_tokens: int) -> torch.Tensor:
        """RoPE positions of the next tokens: (T,) when no row is padded, else (B, T)."""
        device = self.keys.device
        if valid is None and self.row_lengths is None:
            return torch.arange(self.length, self.length + new_tokens, device=device)
        if valid is None:
            valid = torch.ones(self.batch_size, new_tokens, dtype=torch.bool, device=device)
        seen = (
            self.row_lengths
            if self.row_lengths is not None
            else torch.zeros(self.batch_size, dtype=torch.long, device=device)
        )
        return (seen[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)

    def key_mask(self, valid: torch.Tensor | None, new_tokens: int) -> torch.Tensor | None:
        """(B, length + T) marks of real keys, or None when every key is real."""
        if valid is None and self.valid is None:
            return None
        if self.valid is None:
            self.valid = torch.ones(self.batch_size, self.max_len, dtype=torch.bool, device=self.keys.device)
        end = self.length + new_tokens
        self.valid[:, self.length : end] = True if valid is None else valid
        return self.valid[:, :end]

    def advance(self, new_tokens: int, valid: torch.Tensor | None = None) -> None:
        """Move the length past a step of T tokens whose keys every layer has written."""
        if valid is not None or self.row_lengths is not None:
            counted = new_tokens if valid is None else valid.long().sum(1)
            base = self.row_lengths if self.row_lengths is not None else 0
            self.row_lengths = base + counted
        self.length += new_tokens

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (chat rollback); the buffers stay allocated."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KVCache of length {self.length} to {length}")
        if self.valid is not None:
            self.valid[:, length:] = False
            self.row_lengths = self.valid[:, :length].long().sum(1)
        self.length = length

    def reset(self) -> None:
        self.truncate(0)
        self.valid = None
        self.row_lengths = None
