import dataclasses, torch
from torchao.float8 import Float8LinearConfig
try:
    dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), enable_fsdp_float8_all_gather=True)
except Exception as e: print("rowwise+fp8ag:", type(e).__name__, e)
one=torch.tensor(1.0)
for (M,K,N) in [(64,100,64),(64,128,100),(30,128,64)]:
    a=torch.randn(M,K).to(torch.float8_e4m3fn); b=torch.randn(N,K).to(torch.float8_e4m3fn).t()
    try: torch._scaled_mm(a,b,scale_a=one,scale_b=one,out_dtype=torch.bfloat16); print((M,K,N),"OK on CPU")
    except Exception as e: print((M,K,N),"FAIL",type(e).__name__,str(e)[:200])
