"""ATOM's real model code and server start-up on the CPU: :mod:`.on_cpu` (ATOM importable without
ROCm), :mod:`.install` (``check-engine atom``: its loader on the source against the adapter's
install of the converted folder), :mod:`.mla` (its MLA W_K/W_V derivation, run and checked),
:mod:`.serve` (``check-engine atom --serve``: its whole server start-up on both sides) and
:mod:`.matrix` (``check-atom-matrix``: the install check over many configurations)."""
