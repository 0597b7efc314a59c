"""Print a model config's fingerprint, parameter count and KV-cache bytes per token (no weights)."""

import hydra
import torch
from omegaconf import DictConfig

from octlm.config import decoder_config, register_configs
from octlm.inspect import describe

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="inspect_model")
def main(cfg: DictConfig) -> None:
    info = describe(decoder_config(cfg.model.arch), getattr(torch, cfg.kv_dtype))
    print(f"model:              {cfg.model.name}")
    print(f"fingerprint:        {info['fingerprint']}")
    print(f"parameters:         {info['parameters']:,}")
    print(f"kv bytes per token: {info['kv_bytes_per_token']:,} ({info['kv_dtype']})")


if __name__ == "__main__":
    main()
