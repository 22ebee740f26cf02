"""The torch.distributed transport (NCCL on GPUs, gloo on CPU): the one that serves every call.

- ``provider``: the provider and the group's ``DistTransport`` (its row in nsa_cp/transports.py);
- ``moves``: the gathers' and reduce-scatters' movements (source stage into the slot, then the collective);
- ``collectives``: the process group's collectives, bound once per plan;
- ``nccl``: nsa_cp's own NCCL communicator for a group's uneven calls (``init_nccl``);
- ``pipeline``: the overlapped boundary over torch.distributed point-to-point (groups P2P does not serve).
"""
