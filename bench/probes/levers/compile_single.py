# Item 2a: torch.compile per decoder block, single CPU process (inductor).
import os, sys, time, statistics, tempfile, json
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_cold_"))
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from _tiny import tiny_llama
V, H, L, B, S = 1000, 128, 4, 2, 128
torch.set_num_threads(int(os.environ.get("NT", "2")))

def build():
    return tiny_llama(V, H, 344, L, S)

g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(4)]
def step(m, opt, ids):
    loss = m(ids, labels=ids).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True); return loss.detach().item()

def run(compiled, nsteps=10, tag=""):
    m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    if compiled:
        for blk in m.model.layers:
            blk.compile()          # nn.Module.compile: compiles this module's __call__ in place
    ts, losses = [], []
    for i in range(nsteps):
        t = time.perf_counter(); losses.append(step(m, opt, batches[i % 4])); ts.append(time.perf_counter() - t)
    st = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "unimplemented", "graph_break", "inductor") and v}
    later = ts[2:]
    r = dict(tag=tag, first_step_s=round(ts[0], 2), second_step_s=round(ts[1], 3), later_median_ms=round(statistics.median(later)*1e3, 1),
             later_min_ms=round(min(later)*1e3, 1), losses=losses,
             unique_graphs=counters["stats"].get("unique_graphs"), calls_captured=counters["stats"].get("calls_captured"),
             frames_ok=counters["frames"].get("ok"), frames_total=counters["frames"].get("total"),
             recompiles=dict(counters["recompiles"]), graph_breaks=dict(counters["graph_break"]),
             fxgraph_cache=dict((k, v) for k, v in counters["inductor"].items() if "fxgraph" in k))
    print(json.dumps(r), flush=True)
    return r

t0 = time.time()
e = run(False, tag="eager")
c1 = run(True, tag="compiled_cold")
c2 = run(True, tag="compiled_second_model_same_process_no_reset")
torch._dynamo.reset()
c3 = run(True, tag="compiled_after_dynamo_reset_warm_fx_cache")
for c in (c1, c2, c3):
    print(c["tag"], "max|dloss| vs eager:", max(abs(a - b) for a, b in zip(c["losses"], e["losses"])))
print("total", round(time.time() - t0, 1), "s", torch.__version__, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "threads", torch.get_num_threads())
