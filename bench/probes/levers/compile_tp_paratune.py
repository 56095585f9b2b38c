# Item 2c': per-block compile under paratune's own apply_tp (embedding RowwiseParallel, head
# ColwiseParallel), 2 gloo CPU procs, tiny-llama hidden 64, 2 layers, 3 SGD steps; parity vs eager TP.
# argv: SP (0/1) then modes (eager compiled full). Env: FIX=1 applies parallel.compile.
# resolve_async_embedding to compiled modes; DBG=1 prints, for a plain-tensor gradient reaching
# Redistribute.backward, the input placements and the forward stack of that Redistribute.
# Run: PYTHONPATH=$PWD/platform .venv/bin/python bench/probes/levers/compile_tp_paratune.py 1 eager compiled
import os, sys, json, tempfile
import torch, torch.nn.functional as F, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
SP = sys.argv[1] == "1"; MODES = sys.argv[2:] or ["eager", "compiled"]
def worker(rank, world, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29651"))
    torch.set_num_threads(1); dist.init_process_group("gloo", rank=rank, world_size=world)
    from paratune.models import build_config, build_model, decoder_blocks
    from paratune.parallel.tp import apply_tp
    mesh = init_device_mesh("cpu", (world,))
    cfg = build_config("tiny-llama", {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128})
    g = torch.Generator().manual_seed(1); V = cfg.vocab_size
    batches = [torch.randint(0, V, (2, 32), generator=g) for _ in range(3)]
    res = {}
    if os.environ.get("DBG"):
        import traceback
        from torch.distributed.tensor import _redistribute as R
        of, ob = R.Redistribute.forward, R.Redistribute.backward
        def f(ctx, input, *a, **k):
            ctx.where = "".join(traceback.format_stack(limit=14)[:-1]); ctx.inspec = str(input._spec.placements) if hasattr(input, "_spec") else type(input)
            return of(ctx, input, *a, **k)
        def b(ctx, g):
            if not hasattr(g, "_local_tensor") and rank == 0:
                print("PLAIN GRAD", type(g), g.shape, "in", ctx.inspec, "fwd at:\n", ctx.where, flush=True)
            return ob(ctx, g)
        R.Redistribute.forward, R.Redistribute.backward = staticmethod(f), staticmethod(b)
    for mode in MODES:
        try:
            m = build_model(cfg, seed=0); m.train()
            apply_tp(m, mesh, SP)
            if os.environ.get("FIX") and mode != "eager":
                from paratune.parallel.compile import resolve_async_embedding
                resolve_async_embedding(m)
            if mode != "eager":
                for b in decoder_blocks(m): b.compile(**({"fullgraph": True} if mode == "full" else {}))
            opt = torch.optim.SGD(m.parameters(), lr=1e-2); ls = []
            for ids in batches:
                pos = torch.arange(ids.shape[1]).unsqueeze(0)
                out = m(input_ids=ids, position_ids=pos)
                loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten())
                loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); ls.append(loss.item())
            res[mode] = ls
        except Exception as e:
            import traceback; traceback.print_exc(); res[mode] = "FAIL " + repr(e)[:300]
    if rank == 0: q.put(res)
    dist.destroy_process_group()
if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_tp_"))
    ctx = mp.get_context("spawn"); q = ctx.Queue(); mp.spawn(worker, args=(2, q), nprocs=2, join=True); r = q.get()
    print(json.dumps(r))
    if all(isinstance(v, list) for v in r.values()):
        for k in r:
            if k != "eager": print("max|dloss|", k, max(abs(a - b) for a, b in zip(r[k], r["eager"])))
