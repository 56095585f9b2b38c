"""FSDP2 + torchao float8 on 2 gloo CPU ranks. Usage:
  PYTHONPATH=<torchao 0.18.0 installed --no-deps --target DIR> python fsdp2_f8.py --recipe none|tensorwise|rowwise [--fp8ag]
"""
import argparse, json, os, time, statistics, traceback, copy
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, world, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import collections
    AG = collections.Counter()
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as fc
    _orig_meta = fc._get_all_gather_input_metadatas
    def _meta(inputs):
        res = _orig_meta(inputs)
        dts = sorted({str(t.dtype).replace("torch.", "") for ts in inputs for t in ts})
        AG[f"FSDP all-gather param dtypes={dts} -> wire dtype={str(res[2]).replace('torch.', '')}"] += 1
        return res
    fc._get_all_gather_input_metadatas = _meta
    r = {"rank": rank, "recipe": args.recipe, "fp8_allgather": args.fp8ag, "prec": "bf16params"}
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
        from torch.distributed.fsdp import fully_shard
        from torchao.float8 import convert_to_float8_training, Float8LinearConfig
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                          max_position_embeddings=256, attn_implementation="sdpa")
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        if args.recipe != "none":
            c = Float8LinearConfig.from_recipe_name(args.recipe)
            if args.fp8ag:
                import dataclasses
                c = dataclasses.replace(c, enable_fsdp_float8_all_gather=True)
            filt = lambda mod, fqn: not fqn.endswith("lm_head") and mod.weight.shape[0] % 16 == 0 and mod.weight.shape[1] % 16 == 0
            convert_to_float8_training(m, module_filter_fn=filt, config=c)
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        precompute = None
        if args.fp8ag:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            precompute = precompute_float8_dynamic_scale_for_fsdp
        g = torch.Generator().manual_seed(1 + rank)
        batch = torch.randint(0, 1024, (2, 128), generator=g)
        losses, times = [], []
        for i in range(args.steps):
            t0 = time.perf_counter()
            out = m(input_ids=batch, labels=batch)
            out.loss.backward()
            opt.step(); opt.zero_grad(set_to_none=True)
            if i == 1:
                r["allgathers_step1"] = dict(AG)
            AG.clear()
            if precompute is not None:
                precompute(m)
            l = out.loss.detach().clone(); dist.all_reduce(l); l /= world
            times.append(time.perf_counter() - t0); losses.append(l.item())
        r.update(ok=True, losses=losses, median_step_s=round(statistics.median(times[2:]), 4),
                 weight_type=type(m.model.layers[0].self_attn.q_proj.weight).__name__,
                 local_weight_type=type(getattr(m.model.layers[0].self_attn.q_proj.weight, "_local_tensor", None)).__name__)
    except Exception as e:
        r.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500], tb_tail=traceback.format_exc()[-2500:])
    q.put(r)
    try:
        dist.destroy_process_group()
    except Exception:
        pass

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="tensorwise")
    p.add_argument("--fp8ag", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--port", type=int, default=29611)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(i, 2, args, q)) for i in range(2)]
    for x in ps: x.start()
    res = [q.get(timeout=170) for _ in ps]
    for x in ps: x.join(timeout=20)
    for r in sorted(res, key=lambda r: r["rank"]):
        if r["rank"] == 0 or not r["ok"]:
            print(json.dumps(r))
