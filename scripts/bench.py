"""Benchmark octlm against transformers (decode, prefill, load, cache, chat, train); print one table."""

import hydra
from omegaconf import DictConfig, OmegaConf

from octlm.bench import BenchSettings, format_table, run
from octlm.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(cfg: DictConfig) -> None:
    settings: BenchSettings = OmegaConf.to_object(cfg)
    _, rows, stem = run(settings)
    print(format_table(rows))
    print(f"results: {stem.with_suffix('.jsonl')}\nplot:    {stem.with_suffix('.png')}")


if __name__ == "__main__":
    main()
