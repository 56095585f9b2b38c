# Item 2 extra: second plan with a DIFFERENT shape in the same process (micro-batch / seq change) -> recompile cost.
import os, tempfile, time, json
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_shape_"))
import torch
from torch._dynamo.utils import counters
exec(open(__import__("pathlib").Path(__file__).with_name("compile_single.py")).read().split("t0 = time.time()")[0].replace("def run(", "def _unused("))
UC = os.environ.get("USE_CACHE", "default")
def run(Bx, Sx, tag):
    m = build(); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    if UC == 'off': m.config.use_cache = False
    for blk in m.model.layers: blk.compile()
    ids = torch.randint(0, V, (Bx, Sx)); ts = []
    for i in range(3):
        t = time.perf_counter(); step(m, opt, ids); ts.append(time.perf_counter() - t)
    print(tag, f"B={Bx} S={Sx} first {ts[0]:.2f}s then {ts[1]*1e3:.0f} ms; unique_graphs={counters['stats'].get('unique_graphs')} frames={dict(counters['frames'])} fx={dict((k,v) for k,v in counters['inductor'].items() if 'fxgraph' in k)}", flush=True)
run(2, 128, "plan1")
run(2, 128, "plan2 same shape")
run(4, 128, "plan3 batch 4")
run(4, 64, "plan4 batch 4 seq 64")
run(8, 32, "plan5 batch 8 seq 32")
