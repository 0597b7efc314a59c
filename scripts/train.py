"""Train a decoder on prepared token files: python scripts/train.py model=tinystories data=tinystories.

Under torchrun (torchrun --nproc_per_node 2 scripts/train.py ...) the same command trains
data-parallel with DDP. Every setting is a Hydra override; see conf/train.yaml.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.config import register_configs
from octlm.generation import exit_on_user_error
from octlm.train import train

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        train(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
