# Item 2b: per-block torch.compile under DDP and FSDP2 on 2 gloo CPU processes.
# usage: compile_dist.py ddp|fsdp2 [eager]
import os, sys, time, statistics, json, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch._dynamo.utils import counters
from _tiny import tiny_llama
V, H, L, B, S = 1000, 128, 4, 2, 128
STRAT = sys.argv[1]; COMPILE = "eager" not in sys.argv[2:]

def build():
    return tiny_llama(V, H, 344, L, S)

def wrap(m):
    if COMPILE:
        for blk in m.model.layers:
            blk.compile()
    if STRAT == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(m)
    from torch.distributed.fsdp import fully_shard
    for blk in m.model.layers:
        fully_shard(blk)
    fully_shard(m)
    return m

def worker(rank, world, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29623")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
    out = {}
    for plan in ["plan1", "plan2_same_shapes_same_process"]:
        try:
            m = wrap(build()); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            ts, losses = [], []
            for i in range(8):
                t = time.perf_counter()
                loss = m(batches[i % 4], labels=batches[i % 4]).loss
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
                lv = loss.detach().clone(); dist.all_reduce(lv); losses.append(lv.item() / world)
                ts.append(time.perf_counter() - t)
            out[plan] = dict(first_step_s=round(ts[0], 2), later_median_ms=round(statistics.median(ts[2:]) * 1e3, 1),
                             losses=losses, unique_graphs=counters["stats"].get("unique_graphs"),
                             recompiles=dict(counters["recompiles"]), graph_breaks=dict(counters["graph_break"]),
                             frames_ok=counters["frames"].get("ok"))
        except Exception as e:
            import traceback; traceback.print_exc()
            out[plan] = "FAIL " + repr(e)[:800]
            break
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()

if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_dist_"))
    ctx = mp.get_context("spawn"); q = ctx.Queue(); t = time.time()
    mp.spawn(worker, args=(2, q), nprocs=2, join=True)
    r = q.get()
    print(STRAT, "compiled" if COMPILE else "eager", json.dumps(r))
    print("wall", round(time.time() - t, 1), "s", torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
