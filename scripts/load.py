"""Resolve, verify and load a pretrained snapshot; print the manifest check, size, dtype, memory and time."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.config import register_configs
from octlm.generation import exit_on_user_error
from octlm.qwen import run_load

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="load")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        lines = run_load(OmegaConf.to_object(cfg))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
