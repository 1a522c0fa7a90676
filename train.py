"""Train a Transformer: `python train.py key=value ...` (Hydra overrides; see configs/)."""

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from transformer.config import hydra_error_line, register_schema, to_config
from transformer.errors import exit_on_user_error


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        config = to_config(cfg)
        from transformer.training import run  # after config checks: keeps `--help` and errors fast

        hydra_cfg = HydraConfig.get()
        # Written into the run directory only once the run is known to start (configs/config.yaml
        # keeps Hydra from writing them before the checks).
        record = {
            "config.yaml": OmegaConf.to_yaml(cfg),
            "overrides.yaml": OmegaConf.to_yaml(list(hydra_cfg.overrides.task)),
        }
        overrides = list(hydra_cfg.overrides.task)  # init_from refuses those that change its architecture
        run(config, Path(hydra_cfg.runtime.output_dir), record=record, overrides=overrides)


@contextmanager
def hydra_errors_in_one_line():
    """Hydra's own errors (an unknown config group or key, a malformed override, a value of the
    wrong type) and failures before the run starts (a run directory it cannot create) as one
    'error: ...' line and exit status 2."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises them instead of printing them over many lines
    try:
        yield
    except HydraException as e:
        print(f"error: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    register_schema()
    with exit_on_user_error(), hydra_errors_in_one_line():
        main()
