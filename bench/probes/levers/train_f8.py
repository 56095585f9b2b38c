"""Tiny Llama float8 training probe on CPU. Usage:
  PYTHONPATH=<torchao 0.18.0 installed --no-deps --target DIR> python train_f8.py --prec bf16params|autocast [--compile] [--recipes none,tensorwise,rowwise]
"""
import argparse, copy, json, statistics, time, traceback, collections, os
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from torchao.float8 import convert_to_float8_training, Float8LinearConfig

p = argparse.ArgumentParser()
p.add_argument("--prec", default="bf16params")
p.add_argument("--compile", action="store_true")
p.add_argument("--recipes", default="none,tensorwise,rowwise")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--hidden", type=int, default=256)
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(2)
H = args.hidden
cfg = LlamaConfig(hidden_size=H, intermediate_size=3 * H, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                  max_position_embeddings=256, attn_implementation="sdpa")
base = LlamaForCausalLM(cfg)
if args.prec == "bf16params":
    base = base.to(torch.bfloat16)
B, T = 4, 128
g = torch.Generator().manual_seed(1)
batch = torch.randint(0, cfg.vocab_size, (B, T), generator=g)

MM_OPS = {"mm", "addmm", "bmm", "_scaled_mm", "matmul", "linear", "baddbmm",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math"}
class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.c = collections.Counter()
    def __torch_dispatch__(self, func, types, a=(), kw=None):
        kw = kw or {}
        name = func._overloadpacket.__name__
        if name in MM_OPS:
            sig = []
            for x in list(a)[:2]:
                if isinstance(x, torch.Tensor):
                    tn = type(x).__name__
                    dt = getattr(x, "_data", x).dtype
                    sig.append(f"{tn}:{str(dt).replace('torch.','')}")
            self.c[f"aten.{name}({', '.join(sig)})"] += 1
        return func(*a, **kw)

# count real _scaled_mm calls (issued inside the subclass's __torch_dispatch__, invisible to the mode)
_orig_smm = torch._scaled_mm
SMM = collections.Counter()
def _smm(a, b, *ar, **kw):
    SMM[f"_scaled_mm({a.dtype},{b.dtype})->{kw.get('out_dtype')} scale_a{tuple(kw['scale_a'].shape)}"] += 1
    return _orig_smm(a, b, *ar, **kw)
if not args.compile:  # patching breaks inductor's extern-kernel call (it calls torch._scaled_mm positionally)
    torch._scaled_mm = _smm

def filt(mod, fqn):
    if fqn == "lm_head" or fqn.endswith("lm_head"):
        return False
    N, K = mod.weight.shape
    return N % 16 == 0 and K % 16 == 0

def step(model, opt):
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.prec == "autocast" else torch.autocast("cpu", enabled=False)
    with ctx:
        out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    return out.loss.item()

results = {}
for recipe in args.recipes.split(","):
    r = {"recipe": recipe, "prec": args.prec, "compile": args.compile}
    try:
        m = copy.deepcopy(base)
        if recipe != "none":
            c = Float8LinearConfig.from_recipe_name(recipe)
            convert_to_float8_training(m, module_filter_fn=filt, config=c)
            r["n_float8_linears"] = sum(type(x).__name__ == "Float8Linear" for x in m.modules())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        fn = m
        if args.compile:
            fn = torch.compile(m)
        losses, times = [], []
        for i in range(args.steps):
            SMM.clear()
            t0 = time.perf_counter()
            if i == 1 and not args.compile:
                cm = Count()
                with cm:
                    l = step(fn, opt)
                r["dispatch_counts_step1"] = dict(cm.c)
                r["scaled_mm_calls_step1"] = dict(SMM)
            else:
                l = step(fn, opt)
            dt = time.perf_counter() - t0
            if i == 0:
                r["first_step_s"] = round(dt, 3)
            if i == 2 and not args.compile:
                r["scaled_mm_calls_step2"] = dict(SMM)
            losses.append(l); times.append(dt)
        r["losses"] = losses
        r["median_step_s_after_warmup"] = round(statistics.median(times[2:]), 4)
        r["ok"] = True
    except Exception as e:
        r["ok"] = False
        r["error"] = f"{type(e).__name__}: {e}"[:1500]
        r["tb_tail"] = traceback.format_exc()[-1500:]
    results[recipe] = r
    print(json.dumps(r), flush=True)

if "none" in results and results["none"].get("ok"):
    L0 = results["none"]["losses"][:5]
    for k, r in results.items():
        if k != "none" and r.get("ok"):
            print(f"{k}: max|loss diff| vs none over 5 steps = {max(abs(a-b) for a,b in zip(L0, r['losses'][:5])):.5f}")
