"""Lightning's Trainer with its DDP strategy on the backend named on the command line, a few steps:

    pycoll run -n 2 python tests/framework_jobs/lightning_job.py --backend pycoll --out DIR
    python tests/framework_jobs/lightning_job.py --backend pycoll --devices 2 --out DIR   # Lightning launches

Unmodified Lightning: `DDPStrategy(process_group_backend="pycoll")` is the one line that selects pycoll.
Each rank writes its final weights to DIR/rank<R>.pt.
"""
import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import common


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = common.model()

    def training_step(self, batch, index):
        x, y = batch
        return common.loss(self.net(x), y)

    def configure_optimizers(self):
        return common.optimizer(self.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="pycoll")
    parser.add_argument("--devices", type=int, default=2, help="processes (as many as the launcher starts)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, max_steps=common.STEPS,
                        strategy=DDPStrategy(process_group_backend=args.backend),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, DataLoader(common.dataset(), batch_size=common.BATCH))  # Lightning adds the sampler
    common.save(args.out, trainer.global_rank, dict(module.net.named_parameters()),
                torch.distributed.get_backend())


if __name__ == "__main__":
    main()
