# Item 1: selective activation checkpointing through transformers' own hooks, CPU.
import time, statistics, sys, copy, json
from functools import partial
import torch, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
from torch.distributed._tools.mem_tracker import MemTracker
from _tiny import selective_policy, tiny_llama
aten = torch.ops.aten
V, H, L, B, S = 2000, 256, 4, 4, 256
seen = {}
policy = selective_policy(seen=seen)

def build(mode):
    m = tiny_llama(V, H, 688, L, S)
    if mode == "full":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "every2":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    elif mode == "sac_op":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, policy)})
    return m

g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
def step(m, opt, ids):
    loss = m(ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return loss.detach()

res = {}
modes = sys.argv[1:] or ["none", "sac_op", "full", "every2"]
for mode in modes:
    m = build(mode); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    flags = [l.gradient_checkpointing for l in m.model.layers]
    losses = [step(m, opt, b).item() for b in batches]  # 4 steps for parity (distinct batches)
    # peak memory of one step (params+grads+opt state exist already)
    mt = MemTracker(); mt.track_external(m, opt)
    with mt:
        step(m, opt, batches[0])
    peak = mt.get_tracker_snapshot("peak")
    pk = {k: round(v / 2**20, 2) for d, snap in peak.items() for k, v in snap.items()}
    # step time
    ts = []
    for i in range(10):
        t = time.perf_counter(); step(m, opt, batches[i % 4]); ts.append(time.perf_counter() - t)
    res[mode] = dict(losses=losses, peak_MiB=pk, median_s=statistics.median(ts[2:]), min_s=min(ts[2:]), max_s=max(ts[2:]), layer_ckpt=flags)
    print(mode, json.dumps(res[mode]), flush=True)
base = res.get("none")
if base:
    for mode, r in res.items():
        print(f"{mode:7s} max|dloss| vs none = {max(abs(a-b) for a, b in zip(r['losses'], base['losses'])):.3e}  peak Total {r['peak_MiB'].get('Total')} MiB  Act {r['peak_MiB'].get('Act')}  median {r['median_s']*1e3:.1f} ms")
print("policy saw (op -> saved):", json.dumps(seen))
print(torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
