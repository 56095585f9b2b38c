import torch, time, statistics
torch.set_num_threads(2)
def bench(f, n=15):
    f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
M,K,N=512,1024,3072
a=torch.randn(M,K); b=torch.randn(N,K)
abf=a.bfloat16(); bbf=b.bfloat16()
a4=a.to(torch.float8_e4m3fn); b4=b.to(torch.float8_e4m3fn).t(); a5=a.to(torch.float8_e5m2)
one=torch.tensor(1.0)
print(f"M,K,N={M},{K},{N} (ms, median of 15)")
print("bf16 mm", round(bench(lambda: abf@bbf.t()),2))
print("fp32 mm", round(bench(lambda: a@b.t()),2))
print("_scaled_mm e4m3xe4m3 tensorwise->bf16", round(bench(lambda: torch._scaled_mm(a4,b4,scale_a=one,scale_b=one,out_dtype=torch.bfloat16)),2))
print("_scaled_mm e4m3xe4m3 tensorwise fast_accum->bf16", round(bench(lambda: torch._scaled_mm(a4,b4,scale_a=one,scale_b=one,out_dtype=torch.bfloat16,use_fast_accum=True)),2))
print("_scaled_mm e5m2xe4m3 tensorwise->bf16", round(bench(lambda: torch._scaled_mm(a5,b4,scale_a=one,scale_b=one,out_dtype=torch.bfloat16)),2))
print("_scaled_mm e4m3xe4m3 rowwise->bf16", round(bench(lambda: torch._scaled_mm(a4,b4,scale_a=torch.ones(M,1),scale_b=torch.ones(1,N),out_dtype=torch.bfloat16)),2))
