"""A 'real' trainer: logging, tqdm, optional DDP (torchrun, gloo). Same MoE router bias bug as moe_bias.py."""
import argparse, logging, os, sys, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
p = argparse.ArgumentParser(); p.add_argument("--no-ac", action="store_true"); p.add_argument("--debug", action="store_true")
p.add_argument("--steps", type=int, default=4); p.add_argument("--fixed", action="store_true"); p.add_argument("--bug-step", type=int, default=2); p.add_argument("--bug-rank", type=int, default=-1)
args = p.parse_args()
ddp = "RANK" in os.environ
if ddp: dist.init_process_group("gloo")
rank = dist.get_rank() if ddp else 0
logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [%(levelname)s] [rank{rank}] %(name)s: %(message)s")
log = logging.getLogger("trainer")
torch.manual_seed(0)
D, H, E, T = 32, 64, 4, 96
class MoE(nn.Module):
    def __init__(s):
        super().__init__(); s.gate = nn.Linear(D, E, bias=False); s.register_buffer("expert_bias", torch.zeros(E))
        s.w1 = nn.Parameter(torch.randn(E, D, H) * 0.1); s.w2 = nn.Parameter(torch.randn(E, H, D) * 0.1); s.counts = None
    def forward(s, x):
        scores = s.gate(x).sigmoid()
        _, idx = torch.topk(scores + s.expert_bias, 1, dim=-1)
        w = scores.gather(-1, idx); flat = idx.view(-1)
        s.counts = torch.bincount(flat, minlength=E)
        order = flat.argsort(); xs = x[order]
        outs = [F.gelu(c @ s.w1[e]) @ s.w2[e] for e, c in enumerate(xs.split(s.counts.tolist()))]
        y = torch.empty_like(xs); y[order] = torch.cat(outs)
        return y * w
class Block(nn.Module):
    def __init__(s): super().__init__(); s.norm = nn.LayerNorm(D); s.moe = MoE()
    def forward(s, x): return x + s.moe(s.norm(x))
class Net(nn.Module):
    def __init__(s): super().__init__(); s.layers = nn.ModuleList(Block() for _ in range(2)); s.head = nn.Linear(D, 1)
    def forward(s, x):
        for b in s.layers:
            x = b(x) if args.no_ac else checkpoint(b, x, use_reentrant=False, debug=args.debug)
        return s.head(x).pow(2).mean()
net = Net(); model = nn.parallel.DistributedDataParallel(net) if ddp else net
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
def balance():
    with torch.no_grad():
        for b in net.layers:
            c = b.moe.counts.float(); b.moe.expert_bias.add_(0.05 * torch.sign(c.mean() - c))
log.info("starting training: %d steps, world=%d", args.steps, dist.get_world_size() if ddp else 1)
try:
    for step in tqdm(range(args.steps), desc=f"train[r{rank}]", file=sys.stderr, mininterval=0):
        x = torch.randn(T, D, generator=g)
        loss = model(x)
        buggy = step >= args.bug_step and not args.fixed and args.bug_rank in (-1, rank)
        if buggy: balance()
        loss.backward()
        if not buggy: balance()
        opt.step(); opt.zero_grad()
        log.info("step %d loss %.5f", step, loss.item())
except Exception:
    log.exception("training failed at step %d", step)
    raise
finally:
    if ddp: dist.destroy_process_group()
