"""Run an evaluation task (task=parity: octlm against transformers on one snapshot) and print its figures."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.config import register_configs
from octlm.evaluate import result_lines, run_task
from octlm.generation import exit_on_user_error

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        results = run_task(OmegaConf.to_object(cfg))
    print("\n".join(result_lines(results)))
    if results.get("passed") is False:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
