# Which aten ops does a Llama decoder block dispatch on CPU (fwd)?
import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.c = collections.Counter()
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.c[str(func)] += 1; return func(*args, **(kwargs or {}))
for impl in ["sdpa", "eager"]:
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    cfg._attn_implementation = impl
    m = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 1000, (2, 32))
    for dt in [torch.float32, torch.bfloat16]:
        m = m.to(dt)
        with Log() as l:
            m(ids).logits.sum().backward()
        print(impl, dt, sorted(k for k in l.c if any(x in k for x in ["mm", "attention", "bmm", "matmul", "linear"])))
