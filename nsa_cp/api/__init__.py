"""The public entry points: the collectives, their torch.compile ops, the layer communicator, MoE helpers. (docs/design.md, "Code map")."""
