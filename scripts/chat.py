"""Chat in the terminal: `python scripts/chat.py model=qwen3`; pipe lines in to script it (conf/chat.yaml)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.chat import run_chat
from octlm.config import register_configs
from octlm.generation import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="chat")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        run_chat(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
