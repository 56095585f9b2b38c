# Item 3 extra: what collectives does CE on vocab-sharded logits issue, with and without loss_parallel (CommDebugMode).
import os, torch, torch.nn.functional as F, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
def w(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29653"); dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,)); N, V = 64, 1000
    full = torch.randn(N, V, generator=torch.Generator().manual_seed(0)); tgt = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    for ctx in ["loss_parallel", "plain"]:
        x = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        cm = CommDebugMode()
        with cm:
            if ctx == "loss_parallel":
                with loss_parallel():
                    from torch.distributed.tensor import Replicate; l = F.cross_entropy(x, distribute_tensor(tgt, mesh, [Replicate()])); l.backward()
            else:
                from torch.distributed.tensor import Replicate; l = F.cross_entropy(x, distribute_tensor(tgt, mesh, [Replicate()])); l.backward()
        if rank == 0:
            print(ctx, {str(k): v for k, v in cm.get_comm_counts().items()}, "grad placements", x.grad.placements, "local grad", tuple(x.grad.to_local().shape))
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(w, args=(2,), nprocs=2, join=True)
