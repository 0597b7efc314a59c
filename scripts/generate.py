"""Generate text: `python scripts/generate.py model=qwen3 prompt="What is 2 + 2?"` (conf/generate.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.config import register_configs
from octlm.generation import exit_on_user_error, run_generate

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        run_generate(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
