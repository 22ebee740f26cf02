"""How bytes move between ranks: nccl.py (NCCL/gloo through torch.distributed), p2p.py (intranode
symmetric memory + the nsa_cp._C kernels)."""
