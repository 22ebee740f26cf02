"""The geometry of a call: layouts, the in-seq split, the wire formats, call stages, the P2P workspace. (docs/design.md, "Code map")."""
