"""Per-op CPU time of one training step at hidden 1024 (bf16 params), none/tensorwise/rowwise."""
import copy, sys, torch
from torch.profiler import profile, ProfilerActivity
from transformers import LlamaConfig, LlamaForCausalLM
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
torch.manual_seed(0); torch.set_num_threads(2)
H=1024
cfg = LlamaConfig(hidden_size=H, intermediate_size=3*H, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=1024, max_position_embeddings=256, attn_implementation="sdpa")
base = LlamaForCausalLM(cfg).to(torch.bfloat16)
batch = torch.randint(0, 1024, (4, 128))
filt = lambda mod, fqn: not fqn.endswith("lm_head")
for recipe in sys.argv[1].split(","):
    m = copy.deepcopy(base)
    if recipe != "none":
        convert_to_float8_training(m, module_filter_fn=filt, config=Float8LinearConfig.from_recipe_name(recipe))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    def step():
        m(input_ids=batch, labels=batch).loss.backward(); opt.step(); opt.zero_grad()
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    print(f"=== {recipe}")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=28, max_shapes_column_width=70))
