# Item 2c: per-block compile under DTensor TP (2 gloo CPU procs) + loss_parallel; parity vs eager TP.
import os, sys, time, copy, json, statistics, tempfile
import torch, torch.nn.functional as F, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate, DTensor
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel, loss_parallel
from _tiny import selective_policy, tiny_llama
V, H, L, B, S = 1000, 128, 2, 2, 64
MODES = sys.argv[1:] or ["eager", "compiled"]
def build(mesh):
    m = tiny_llama(V, H, 256, L, S)
    plan = {"lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)}
    for i in range(L):
        p = f"model.layers.{i}."
        for n in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]: plan[p+n] = ColwiseParallel()
        for n in ["self_attn.o_proj", "mlp.down_proj"]: plan[p+n] = RowwiseParallel()
    parallelize_module(m, mesh, plan); return m
def worker(rank, world, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29643")
    torch.set_num_threads(1); dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1); batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
    res = {}
    for mode in MODES:
        try:
            m = build(mesh)
            if mode.startswith("sac"):
                from functools import partial
                from torch.utils.checkpoint import create_selective_checkpoint_contexts
                aten = torch.ops.aten; c10 = torch.ops._c10d_functional
                SAVE = {aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
                        c10.reduce_scatter_tensor.default, c10.all_reduce.default}
                pol = selective_policy(SAVE)  # under TP the functional collectives too
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, pol)})
            if "compiled" in mode:
                for blk in m.model.layers: blk.compile()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False); ls, ts = [], []
            for i in range(6):
                t = time.perf_counter()
                logits = m.lm_head(m.model(batches[i % 4]).last_hidden_state)
                with loss_parallel():
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), batches[i % 4].flatten()); loss.backward()
                opt.step(); opt.zero_grad(set_to_none=True)
                ls.append(loss.full_tensor().item()); ts.append(time.perf_counter() - t)
            from torch._dynamo.utils import counters
            res[mode] = dict(losses=ls, first_s=round(ts[0], 2), later_median_ms=round(statistics.median(ts[2:])*1e3, 1),
                             graph_breaks=dict(counters["graph_break"]), recompiles=dict(counters["recompiles"]))
        except Exception as e:
            import traceback; traceback.print_exc(); res[mode] = "FAIL " + repr(e)[:800]
    if rank == 0: q.put(res)
    dist.destroy_process_group()
if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_tp_"))
    ctx = mp.get_context("spawn"); q = ctx.Queue(); mp.spawn(worker, args=(2, q), nprocs=2, join=True); r = q.get()
    print(json.dumps(r))
    if all(isinstance(v, dict) for v in r.values()):
        [print(f"max|dloss| {k} vs eager TP:", max(abs(a-b) for a, b in zip(r[k]["losses"], r["eager"]["losses"]))) for k in r if k != "eager"]
    print(torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
