# Item 1 cross-check of MemTracker: TorchDispatchMode counting live storage bytes created during fwd+bwd.
import sys, weakref, json
sys.argv = [sys.argv[0], "__none__"]
exec(open(__import__("pathlib").Path(__file__).with_name("sac_check.py")).read().split("res = {}")[0])
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
class Live(TorchDispatchMode):
    def __init__(s): super().__init__(); s.live = {}; s.cur = 0; s.peak = 0
    def _free(s, key):
        s.cur -= s.live.pop(key, 0)
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage(); key = st.data_ptr()
                if key and key not in s.live:
                    s.live[key] = st.nbytes(); s.cur += st.nbytes(); s.peak = max(s.peak, s.cur)
                    weakref.finalize(st, s._free, key)
        return out
for mode in ["none", "sac_op", "full", "every2"]:
    m = build(mode)
    ids = batches[0]
    with Live() as lv:
        loss = m(ids, labels=ids).loss
        after_fwd = lv.cur
        loss.backward()
    print(f"{mode:7s} live bytes created: after fwd {after_fwd/2**20:7.2f} MiB, peak fwd+bwd {lv.peak/2**20:7.2f} MiB (includes grads)")
