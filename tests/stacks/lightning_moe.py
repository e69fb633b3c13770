"""PyTorch Lightning: the tiny checkpointed MoE trained by `lightning.Trainer` with gradient accumulation.

    ac-diff run --json r.json lightning_moe.py                               # clean
    ac-diff run --json r.json lightning_moe.py --bias-update training_step   # state_mutation

`--bias-update` says where the MoE load-balancing `expert_bias` update runs:
    optimizer_step  `on_before_optimizer_step` (after every backward of the accumulation window: right)
    training_step   at the end of `training_step`, i.e. after the forward and BEFORE Lightning calls
                    backward on the returned loss (a natural mistake: the recompute sees the new bias)
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

import lightning.pytorch as pl
from ac_diff._examples import tiny_moe


class Tokens(Dataset):
    def __init__(self, margs, n, seq_len):
        self.items = [tiny_moe.make_batch(margs, i, seed=0, batch_size=1, seq_len=seq_len) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        inputs, labels = self.items[i]
        return inputs[0], labels[0]


class MoEModule(pl.LightningModule):
    def __init__(self, margs, bias_update):
        super().__init__()
        self.model = tiny_moe.build_model(margs, seed=0, ac_mode="checkpoint_wrapper")
        self.bias_update = bias_update

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = tiny_moe.loss_fn(self.model(inputs), labels)
        if self.bias_update == "training_step":
            for moe in self.model.moe_layers():
                tiny_moe.update_expert_bias(moe)
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.bias_update == "optimizer_step":
            for moe in self.model.moe_layers():
                tiny_moe.update_expert_bias(moe)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bias-update", choices=["optimizer_step", "training_step"], default="optimizer_step")
    p.add_argument("--accumulate", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="optimizer steps")
    args = p.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    margs = tiny_moe.ModelArgs(n_layers=2, num_experts=8, top_k=2)
    data = DataLoader(Tokens(margs, args.accumulate * args.steps, 32), batch_size=1)
    trainer = pl.Trainer(max_steps=args.steps, accumulate_grad_batches=args.accumulate, accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(MoEModule(margs, args.bias_update), data)
    print(f"lightning_moe: {trainer.global_step} optimizer step(s), "
          f"{args.accumulate} micro-batches each", flush=True)


if __name__ == "__main__":
    main()
