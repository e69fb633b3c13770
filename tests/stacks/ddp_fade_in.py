"""DDP (gloo) over blocks that fade their new path in (ProGAN-style): each block counts the real tokens it has seen
in its forward and scales the path by alpha = min(1, seen / 200) while alpha < 1. The recompute counts them again.
Rank 0's batches are full, so its alpha is 1 from the first step and the second count changes nothing it computes;
rank 1's are mostly padding, its alpha still ramps, and its recompute scales by another alpha (silently). The
gradients are all-reduced: rank 0's differ from a run without AC only as rank 1's do.

    torchrun --nproc-per-node 2 tests/stacks/ddp_fade_in.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

RAMP = 200


class FadeBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.tokens_seen = 0

    def forward(self, x, mask):
        self.tokens_seen += int(mask.sum())
        alpha = min(1.0, self.tokens_seen / RAMP)
        h = self.fc1(self.ln(x))
        if alpha < 1.0:
            h = h * alpha
        return x + self.fc2(F.gelu(h)) * mask[..., None]


class Net(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(50, d), torch.nn.Linear(d, 50)
        self.blocks = torch.nn.ModuleList(FadeBlock(d) for _ in range(2))

    def forward(self, tok, mask):
        h = self.emb(tok)
        for b in self.blocks:
            h = checkpoint(b, h, mask, use_reentrant=False)
        return self.head(h)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11 + rank)
    for _ in range(3):
        mask = torch.ones(4, 64)
        if rank == 1:
            mask[:, 6:] = 0  # rank 1 got the short sequences
        tok = torch.randint(1, 50, (4, 64), generator=g) * mask.long()
        logits = model(tok, mask)
        loss = (F.cross_entropy(logits.reshape(-1, 50), tok.roll(-1, 1).reshape(-1), reduction="none")
                * mask.reshape(-1)).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
