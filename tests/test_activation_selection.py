"""The fused activation-quant flags each dense GEMM path needs, around the 32-token threshold."""

import pytest

import layouts as L
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use


@pytest.mark.parametrize("m", [0, 1, 16, 31, 32, 33, 256, 65536])
def test_asm_path_always_shuffles_and_pads(m):
    assert L.select_activation_quant(ATOM.gemm_paths["asm"], m) == (True, True)


@pytest.mark.parametrize("m, want", [(1, False), (31, False), (32, True), (33, True), (4096, True)])
def test_triton_preshuffle_switches_on_at_32_tokens(m, want):
    flags = L.select_activation_quant(ATOM.gemm_paths["triton-preshuffle"], m)
    assert flags.shuffle is want and flags.scale_shuffle_padding is want


@pytest.mark.parametrize("m", [1, 31, 32, 33, 65536])
def test_triton_non_shuffle_never_shuffles(m):
    assert L.select_activation_quant(ATOM.gemm_paths["triton-non-shuffle"], m) == (False, False)


def test_each_gemm_path_names_the_weight_layout_it_reads():
    assert {p: r.weight_layout for p, r in ATOM.gemm_paths.items()} == {
        "asm": "preshuffle", "triton-preshuffle": "preshuffle", "triton-non-shuffle": "non-shuffle"}
    for rule in ATOM.gemm_paths.values():
        assert rule.weight_layout in L.layout_names("dense")


def test_unknown_path_and_negative_tokens_are_refused():
    with pytest.raises(ValueError, match="'ck' is not a GEMM path of ATOM; choose one of asm, "):
        L.ActivationQuantPlan("ck", profile=ATOM)
    with pytest.raises(ValueError, match="num_tokens"):
        L.select_activation_quant(ATOM.gemm_paths["asm"], -1)
