"""Train a Transformer: `python train.py key=value ...` (Hydra overrides; see configs/)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from transformer.config import exit_on_user_error, to_config


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        from transformer.experiment import run  # after config checks: keeps `--help` and errors fast

        run(to_config(cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
