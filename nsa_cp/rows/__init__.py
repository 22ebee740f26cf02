"""Row compute: norms, the FP8 quantizer, the pure-torch reference and the row kernels (Triton, nsa_cp._C). (docs/design.md, "Code map")."""
