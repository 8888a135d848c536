"""Two processes, one GPU: does NCCL form the group and run all_to_all_single? (Tier-2's NCCL path
binds each DataServer to a GPU of its own; this checks what one GPU allows.)"""

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, q):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda:0"))
        n = 64 << 20
        send = torch.full((n * world,), rank, dtype=torch.uint8, device="cuda")
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 5
        q.put(
            (
                rank,
                "ok",
                f"{n * world / 1e6:.0f} MB per rank in {dt * 1e3:.2f} ms ({n * (world - 1) / dt / 1e9:.1f} GB/s out)",
            )
        )
        dist.destroy_process_group()
    except Exception as e:
        q.put((rank, "error", f"{type(e).__name__}: {str(e)[:400]}"))


if __name__ == "__main__":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=run, args=(r, 2, port, q)) for r in range(2)]
    [p.start() for p in ps]
    for _ in ps:
        try:
            print(q.get(timeout=45))
        except Exception:
            print("no answer in 45 s (a hang)")
    [p.kill() for p in ps if p.is_alive()]
