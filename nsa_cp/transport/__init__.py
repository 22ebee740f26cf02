"""How bytes move between ranks: NCCL/gloo through torch.distributed; intranode P2P comes next."""
