"""Distill a teacher into a small, fast student (sequence-level knowledge distillation):

    python distill.py teacher=outputs/de-en/RUN/checkpoint_best.pt
    python distill.py teacher=A.pt ensemble=[B.pt] model=student_base distill.n_best=2 distill.select=best

The teacher translates the training sources, the pairs are filtered, the student trains on them
and gets a shortlist (transformer/training/distill.py has the stages). Every key of train.py
works for the student (experiment=multi30k_de_en_student by default); teacher=, ensemble= and
distill.* are this command's. A stopped run goes on from its stage with the same command and
hydra.run.dir=RUN.
"""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from train import hydra_errors_in_one_line
from transformer.config import DistillRun, register_schema, to_config
from transformer.errors import ConfigError, exit_on_user_error


@hydra.main(version_base="1.3", config_path="configs", config_name="distill")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error():
        if OmegaConf.is_missing(cfg, "teacher"):
            raise ConfigError("missing teacher=PATH: the checkpoint of the model to distill (see --help)")
        config = to_config(cfg, DistillRun)
        from transformer.training.distill import distill  # after config checks: keeps `--help` and errors fast

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        student = config.student(run_dir / "corpus")
        record = {"config.yaml": OmegaConf.to_yaml(OmegaConf.structured(student)), "distill.yaml": OmegaConf.to_yaml(cfg)}  # fmt: skip
        distill(config, run_dir, student, record)


if __name__ == "__main__":
    register_schema()
    with exit_on_user_error(), hydra_errors_in_one_line():
        main()
