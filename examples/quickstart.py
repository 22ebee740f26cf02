"""nsa_cp's quick start (README.md, "Quick start"), as printed there: torchrun --nproc-per-node 2 examples/quickstart.py"""
import os, torch, torch.distributed as dist, nsa_cp
gpu, seq_lens, H = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]), [700] * 8, 1024  # GPU per rank
dist.init_process_group("nccl" if gpu else "gloo"); rank, cp = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")  # this node's GPU
if gpu: torch.cuda.set_device(device)

counts = nsa_cp.in_seq_split(seq_lens, cp, page_size=64)          # tokens per rank (uneven)
layout = nsa_cp.ShardLayout(per_rank_actual_token=counts)
x = torch.randn(counts[rank], H, device=device, dtype=torch.bfloat16)
full = nsa_cp.cp_all_gather(x, layout)                 # padded [M * cp, H], padding rows zero
full = nsa_cp.cp_all_gather(x, layout, compact=True)   # compact [sum(counts), H]
mine = nsa_cp.cp_reduce_scatter(full, layout, compact=True)   # sum over ranks -> [counts[rank], H]
torch.testing.assert_close(mine, cp * x)

pos = torch.cat(nsa_cp.in_seq_positions(seq_lens, cp, page_size=64)).to(device)   # same on every rank
kv = nsa_cp.cp_all_gather(x, layout, positions=pos)    # batch order [T, H] (attention's shared KV)
q, scale = nsa_cp.cp_all_gather(x, layout, quant="fp8_e4m3_g128")  # FP8 wire: e4m3 + fp32 [rows, H/128]
if gpu and nsa_cp.p2p_unavailable_reason() is None:   # one node: the P2P transport, sized once (collective;
    nsa_cp.init_p2p(None, max_tokens_per_rank=32768, hidden_size=H, dtype=torch.bfloat16)  # before graphs)
if gpu and not nsa_cp.nccl_unavailable_reason():      # any node count: nsa_cp's NCCL communicator for the
    nsa_cp.init_nccl(None)                             # NCCL path's uneven calls (collective, once)
print(f"nsa_cp quick start OK: cp={cp}, counts={counts}, gathered {tuple(full.shape)} on {device}") if rank == 0 else None
dist.destroy_process_group()
