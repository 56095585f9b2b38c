# Item 1 timing: modes interleaved round-robin so background load hits all equally.
import time, statistics, sys, os
sys.argv = [sys.argv[0], "__none__"]
exec(open(__import__("pathlib").Path(__file__).with_name("sac_check.py")).read().split("res = {}")[0])
torch.set_num_threads(int(os.environ.get("NT","2")))
models = {mode: build(mode) for mode in ["none", "sac_op", "full", "every2"]}
opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
ts = {k: [] for k in models}
for r in range(int(os.environ.get("R","12"))):
    for k in models:
        t = time.perf_counter(); step(models[k], opts[k], batches[r % 4]); ts[k].append(time.perf_counter() - t)
for k, v in ts.items():
    v = v[2:]
    print(f"{k:7s} median {statistics.median(v)*1e3:7.1f} ms  min {min(v)*1e3:7.1f}  max {max(v)*1e3:7.1f}  (n={len(v)})")
print("threads", torch.get_num_threads(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
