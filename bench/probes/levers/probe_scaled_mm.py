import torch, time
print(torch.__version__, torch.backends.mkldnn.is_available())
a=torch.randn(64,128).to(torch.float8_e4m3fn); b=torch.randn(256,128).to(torch.float8_e4m3fn).t()
one=torch.tensor(1.0)
for name,kw in [("tensorwise bf16",dict(scale_a=one,scale_b=one,out_dtype=torch.bfloat16)),
                ("tensorwise fp32",dict(scale_a=one,scale_b=one,out_dtype=torch.float32)),
                ("rowwise bf16",dict(scale_a=torch.ones(64,1),scale_b=torch.ones(1,256),out_dtype=torch.bfloat16)),
                ("tensorwise bf16 fast_accum",dict(scale_a=one,scale_b=one,out_dtype=torch.bfloat16,use_fast_accum=True)),
                ("e5m2 x e4m3",None)]:
    try:
        if kw is None:
            o=torch._scaled_mm(a.float().to(torch.float8_e5m2),b,scale_a=one,scale_b=one,out_dtype=torch.bfloat16)
        else:
            o=torch._scaled_mm(a,b,**kw)
        ref=(a.float()@b.float())
        print(name,"OK",o.dtype,"maxdiff",(o.float()-ref).abs().max().item())
    except Exception as e:
        print(name,"FAIL",type(e).__name__,str(e)[:300])
