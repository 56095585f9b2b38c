# Compositions: (a) SAC/full ckpt inside per-block compile, single process; (b) FSDP2 / DDP + SAC eager on 2 gloo procs.
import os, sys, time, json, tempfile, statistics
from functools import partial
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.utils.checkpoint import create_selective_checkpoint_contexts, CheckpointPolicy
from _tiny import selective_policy, tiny_llama
aten = torch.ops.aten
V, H, L, B, S = 1000, 128, 4, 2, 128
policy = selective_policy()
def build(ckpt):
    m = tiny_llama(V, H, 344, L, S)
    if ckpt == "sac":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, policy)})
    elif ckpt == "full":
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return m
def steps(m, batches, n=6):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3); out = []; ts = []
    for i in range(n):
        t = time.perf_counter()
        loss = m(batches[i % 4], labels=batches[i % 4]).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        lv = loss.detach().clone()
        if dist.is_initialized(): dist.all_reduce(lv); lv /= dist.get_world_size()
        out.append(lv.item()); ts.append(time.perf_counter() - t)
    return out, ts

def single():
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(1); batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
    ref, _ = steps(build("none"), batches)
    for ck in ["sac", "full"]:
        try:
            m = build(ck)
            for blk in m.model.layers: blk.compile()
            l, ts = steps(m, batches)
            print(f"compile+{ck}: OK max|dloss| vs eager-none {max(abs(a-b) for a,b in zip(l, ref)):.2e} first {ts[0]:.1f}s later median {statistics.median(ts[2:])*1e3:.1f} ms graph_breaks={dict(counters['graph_break'])} recompiles={dict(counters['recompiles'])}", flush=True)
        except Exception as e:
            print(f"compile+{ck}: FAIL {repr(e)[:800]}", flush=True)

def worker(rank, world, q, strat):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29633")
    torch.set_num_threads(1); dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1 + rank); batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
    res = {}
    for ck in ["none", "sac", "full"]:
        try:
            m = build(ck)
            if strat == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                for blk in m.model.layers: fully_shard(blk)
                fully_shard(m)
            else:
                from torch.nn.parallel import DistributedDataParallel as DDP
                m = DDP(m)
            res[ck] = steps(m, batches)[0]
        except Exception as e:
            res[ck] = "FAIL " + repr(e)[:600]
    if rank == 0: q.put(res)
    dist.destroy_process_group()

if __name__ == "__main__":
    if sys.argv[1] == "single":
        single()
    else:
        ctx = mp.get_context("spawn"); q = ctx.Queue()
        mp.spawn(worker, args=(2, q, sys.argv[1]), nprocs=2, join=True)
        r = q.get()
        for k, v in r.items():
            print(sys.argv[1], k, v if isinstance(v, str) else f"OK max|dloss| vs none {max(abs(a-b) for a,b in zip(v, r['none'])):.2e}")
    print(torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
