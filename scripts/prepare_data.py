"""Train the BPE tokenizer and write uint16 token files plus manifest.json (see octlm/data.py)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.config import register_configs
from octlm.data import format_table, prepare
from octlm.generation import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        manifest = prepare(OmegaConf.to_object(cfg))
    print(format_table(manifest))


if __name__ == "__main__":
    main()
