# Item 3: vocab-parallel loss on 2 gloo CPU processes vs unsharded single-process reference.
import os, sys, copy, time, traceback
import torch, torch.nn.functional as F, torch.distributed as dist, torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate, DTensor
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel, loss_parallel

V, H, L, B, S = 1000, 128, 2, 2, 16


def sharded_head(model, mesh):
    """A copy of `model` whose LM head is column-parallel with its output kept vocab-sharded."""
    m = copy.deepcopy(model)
    parallelize_module(m, mesh, {"lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                            use_local_output=False)})
    return m

def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=256, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()

def data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, :3] = -100  # exercise ignore_index
    return ids, labels

def ref_losses(model, ids, labels):
    out = {}
    for red in ["mean", "sum"]:
        model.zero_grad()
        logits = model.lm_head(model.model(ids).last_hidden_state)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction=red)
        loss.backward()
        out[red] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out

def worker(rank, world, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ids, labels = data()
    model = build()
    ref = ref_losses(copy.deepcopy(model), ids, labels)
    res = {}
    # (a) only lm_head vocab-parallel, rest replicated
    # (b) full Megatron-style TP of blocks + vocab-parallel head
    for variant in ["head_only", "full_tp"]:
        m = copy.deepcopy(model)
        plan = {"lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)}
        if variant == "full_tp":
            for i in range(L):
                p = f"model.layers.{i}."
                plan.update({p+"self_attn.q_proj": ColwiseParallel(), p+"self_attn.k_proj": ColwiseParallel(),
                             p+"self_attn.v_proj": ColwiseParallel(), p+"self_attn.o_proj": RowwiseParallel(),
                             p+"mlp.gate_proj": ColwiseParallel(), p+"mlp.up_proj": ColwiseParallel(),
                             p+"mlp.down_proj": RowwiseParallel()})
            for i in range(L):  # local heads
                m.model.layers[i].self_attn.config = copy.copy(m.config)
        parallelize_module(m, mesh, plan)
        if variant == "full_tp":
            # HF attention reshapes with -1 heads so local heads work with view(*input_shape, -1, head_dim)
            pass
        for red in ["mean", "sum"]:
            key = f"{variant}/{red}"
            try:
                m.zero_grad()
                hidden = m.model(ids).last_hidden_state
                logits = m.lm_head(hidden)
                info = f"logits {type(logits).__name__} {getattr(logits,'placements',None)} local {tuple(logits.to_local().shape) if isinstance(logits,DTensor) else None}"
                with loss_parallel():
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction=red)
                    loss.backward()
                lv = loss.full_tensor() if isinstance(loss, DTensor) else loss
                rl, rg = ref[red]
                gd = 0.0
                for n, p in m.named_parameters():
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    gd = max(gd, (g - rg[n]).abs().max().item())
                res[key] = f"OK loss={lv.item():.6f} ref={rl.item():.6f} |dloss|={abs(lv.item()-rl.item()):.2e} max|dgrad|={gd:.2e} loss_type={type(loss).__name__}{getattr(loss,'placements','')} {info}"
            except Exception as e:
                res[key] = "FAIL " + repr(e)[:600]
    # (c) HF's own loss path: model(ids, labels=labels) under loss_parallel with DTensor logits
    try:
        m = sharded_head(model, mesh)
        with loss_parallel():
            out = m(ids, labels=labels)
            out.loss.backward()
        r = copy.deepcopy(model); rl = r(ids, labels=labels).loss
        lv = out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss
        res["hf_labels_path"] = f"OK loss={lv.item():.6f} ref={rl.item():.6f} diff={abs(lv.item()-rl.item()):.2e}"
    except Exception as e:
        res["hf_labels_path"] = "FAIL " + repr(e)[:600]
    # (d) backward outside the context (docs say it must be inside)
    try:
        m = sharded_head(model, mesh)
        logits = m.lm_head(m.model(ids).last_hidden_state)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        g = m.lm_head.weight.grad.full_tensor()
        res["backward_outside_ctx"] = f"ran; max|dgrad lm_head|={(g-ref['mean'][1]['lm_head.weight']).abs().max().item():.2e}"
    except Exception as e:
        res["backward_outside_ctx"] = "FAIL " + repr(e)[:400]
    # (e) label_smoothing
    try:
        m = sharded_head(model, mesh)
        logits = m.lm_head(m.model(ids).last_hidden_state)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=0.1)
            loss.backward()
        res["label_smoothing"] = f"ran loss={loss.full_tensor().item() if isinstance(loss,DTensor) else loss.item():.6f}"
    except Exception as e:
        res["label_smoothing"] = "FAIL " + repr(e)[:400]
    # (f) without loss_parallel: CE on sharded DTensor
    try:
        m = sharded_head(model, mesh)
        logits = m.lm_head(m.model(ids).last_hidden_state)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        res["no_ctx"] = f"ran type={type(loss).__name__}"
    except Exception as e:
        res["no_ctx"] = "FAIL " + repr(e)[:400]
    # (c2) HF path with num_items_in_batch (tensor) -> reduction="sum" then loss / num_items_in_batch
    try:
        m = sharded_head(model, mesh)
        nib = (labels[:, 1:] != -100).sum()
        with loss_parallel():
            out = m(ids, labels=labels, num_items_in_batch=nib)
            out.loss.backward()
        r = copy.deepcopy(model); rl = r(ids, labels=labels, num_items_in_batch=nib).loss; rl.backward()
        lv = out.loss.full_tensor() if isinstance(out.loss, DTensor) else out.loss
        gd = max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - q_.grad).abs().max().item() for p, q_ in zip(m.parameters(), r.parameters()))
        res["hf_labels_num_items_in_batch"] = f"OK loss={lv.item():.6f} ref={rl.item():.6f} diff={abs(lv.item()-rl.item()):.2e} max|dgrad|={gd:.2e}"
    except Exception as e:
        res["hf_labels_num_items_in_batch"] = "FAIL " + repr(e)[:600]
    # (g) 2-D mesh (dp=1, tp=2): logits on the 2-D mesh, reduction mean vs sum
    try:
        mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        from torch.distributed.tensor import distribute_tensor
        full = torch.randn(B * S, V, generator=torch.Generator().manual_seed(3))
        x = distribute_tensor(full, mesh2, [Shard(0), Shard(1)]).requires_grad_()
        tgt = distribute_tensor(labels.flatten(), mesh2, [Shard(0), Replicate()])
        out2 = {}
        for red in ["sum", "mean"]:
            try:
                with loss_parallel():
                    l2 = F.cross_entropy(x, tgt, ignore_index=-100, reduction=red)
                out2[red] = f"OK {l2.full_tensor().item():.4f} ref {F.cross_entropy(full, labels.flatten(), reduction=red).item():.4f}"
            except Exception as e:
                out2[red] = "FAIL " + repr(e)[:300]
        res["mesh2d"] = str(out2)
    except Exception as e:
        res["mesh2d"] = "FAIL " + repr(e)[:400]
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    t = time.time()
    mp.spawn(worker, args=(2, q), nprocs=2, join=True)
    for k, v in q.get().items():
        print(f"{k}: {v}")
    print(f"torch {torch.__version__} wall {time.time()-t:.1f}s")
