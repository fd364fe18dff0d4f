"""Engine profiles: each engine's knowledge has one home (``layouts/engines/<engine>.py``), layout
names one home (``layouts/registry.py``), and everything else asks them. Pinned here: nothing
else spells a layout name, an ATOM switch, an engine or a GEMM path; the CLI's choices are the registry's and the
profile's lists; the profile's tables answer both ways (configuration -> layouts and layouts ->
configuration); and a second engine plugs in from its own module alone."""

import ast
import pathlib

import pytest
import torch

import layouts
from layouts import engines
from layouts import CompatibilityError, EngineConfig, check_compatibility
from layouts.engines import SHARED_CHECKS
from layouts.engines import NEVER, EngineProfile, GemmPathRule, GpuArch
from layouts.manifest import Manifest
from layouts.engines import get_engine

ATOM = get_engine("atom")  # the engine whose profile these tests use

REPO = pathlib.Path(__file__).resolve().parent.parent
# Where the names may be written: the registry defines the layouts, the profiles say who reads them.
HOMES = {REPO / "layouts" / "registry.py", *(REPO / "layouts" / "engines").rglob("*.py")}  # a profile may be a package
# Equal strings that name something else: the fused RMSNorm + quant ops' back ends (aiter, our
# Triton kernel, torch) are not the MoE layout "triton"; nor is a package or folder named triton.
OTHER_MEANING = {("layouts/fused_quant.py", "triton"), ("layouts/fused_fp8_quant.py", "triton"),
                 # the triton package and aiter's aiter/ops/triton folder, which aiter_gemm loads from
                 ("prep/reference/aiter_gemm.py", "triton")}


def _string_constants(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # f-string pieces included
            yield node.lineno, node.value


def test_no_module_outside_the_registry_and_the_profiles_spells_a_layout_or_an_atom_switch():
    names = set(layouts.layout_names())
    found = []
    for path in sorted([*(REPO / "layouts").rglob("*.py"), *(REPO / "prep").rglob("*.py")]):
        if path in HOMES:
            continue
        rel = path.relative_to(REPO).as_posix()
        for line, value in _string_constants(path):
            if (value in names and (rel, value) not in OTHER_MEANING) or value.startswith("ATOM_"):
                found.append(f"{rel}:{line}: {value!r}")
    assert not found, ("ask layouts.registry (layout_names, get_layout) or the engine profile "
                       "(layouts.get_engine(name)) instead: " + "; ".join(found))


# The one place an engine is chosen without being asked (the CLI's --engine when omitted), and the
# manifest format's history (manifests from before target.engine were all ATOM's); and "sglang" as
# the reference engine's MLA order (--mla-order sglang: SGLang's decode arithmetic, not the engine).
ENGINE_NAMED = {("prep/cli/app.py", "atom"), ("layouts/manifest/format.py", "atom"), ("prep/cli/reference.py", "sglang"),
                ("prep/reference/model.py", "sglang"), ("prep/reference/run.py", "sglang")}


def test_no_module_outside_the_profiles_names_an_engine_or_a_gemm_path():
    # The engine is chosen once, at the edge, and its profile passed on: no default engine below it,
    # and a GEMM path is asked of the engine's profile (issue 40).
    names = set(layouts.engine_names()) | {p for e in layouts.engine_names() for p in get_engine(e).gemm_paths}
    found = []
    for path in sorted([*(REPO / "layouts").rglob("*.py"), *(REPO / "prep").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if path in HOMES and path != REPO / "layouts" / "registry.py":
            continue
        found += [f"{rel}:{line}: {value!r}" for line, value in _string_constants(path)
                  if value in names and (rel, value) not in ENGINE_NAMED]
    assert not found, "take the engine's profile from the caller (and its gemm_paths) instead: " + "; ".join(found)


def test_the_scan_sees_what_it_must_refuse(tmp_path):
    # The pin above is only as good as its parser: a constant, a default and an f-string piece.
    f = tmp_path / "m.py"
    f.write_text('A = "preshuffle"\ndef f(x="ck"): return f"ATOM_USE_TRITON_GEMM={x}"\n')
    assert [v for _, v in _string_constants(f)] == ["preshuffle", "ck", "ATOM_USE_TRITON_GEMM="]


def test_cli_choices_are_the_registry_and_profile_lists():
    from prep import cli
    from prep.deepseek import target_for

    convert = {p.name: p for p in cli.convert.params}
    assert list(convert["layout"].type.choices) == layouts.layout_names("dense")
    assert list(convert["moe_layout"].type.choices) == layouts.layout_names("moe")
    default = target_for(layouts.get_engine(cli.DEFAULT_ENGINE))  # the CLI's, its one default engine
    assert (convert["layout"].default(), convert["moe_layout"].default()) == (default.layout, default.moe_layout)
    assert convert["engine"].default == cli.DEFAULT_ENGINE
    for command in (cli.run_cmd, cli.compare):
        gemm = next(p for p in command.params if p.name == "gemm_path")
        assert list(gemm.type.choices) == list(layouts.get_engine(cli.DEFAULT_ENGINE).gemm_paths)


@pytest.mark.parametrize("engine", ["atom", "sglang", "vllm"])
def test_a_plain_convert_targets_what_the_engine_default_configuration_reads(engine):
    from prep.deepseek import target_for

    profile = layouts.get_engine(engine)
    target, default = target_for(profile), EngineConfig(profile=profile)
    assert (target.layout, target.moe_layout) == (default.expected_dense_layout(), default.expected_moe_layout())
    assert target.engine == engine


def test_every_registered_layout_is_read_by_some_engine_path():
    # A layout no engine reads is a registration without its other half: add the path that reads
    # it to that engine's profile (gemm_paths / moe_layouts).
    profiles = [layouts.get_engine(n) for n in layouts.engine_names()]
    assert {r.weight_layout for p in profiles for r in p.gemm_paths.values()} == set(layouts.layout_names("dense"))
    assert {layout for p in profiles for layout in p.moe_layouts.values()} == set(layouts.layout_names("moe"))
    assert {p.bf16_moe_layout for p in profiles} - {None} == set(layouts.layout_names("bf16-moe"))


@pytest.mark.parametrize("engine, flags, message", [
    ("atom", ["--layout", "non-shuffle-t"], "--layout non-shuffle-t: ATOM's GEMM paths read preshuffle or non-shuffle, "
                                            "not non-shuffle-t; convert with one of them, or for another --engine"),
    ("vllm", ["--moe-layout", "ck"], "--moe-layout ck: vLLM's MoE back ends read ck-3d, not ck;"),
    ("sglang", ["--layout", "preshuffle"], "--layout preshuffle: SGLang's GEMM paths read non-shuffle, not preshuffle;"),
])
def test_a_layout_no_path_of_the_engine_reads_is_refused_before_writing(tiny_r1, tmp_path, engine, flags, message):
    from click.testing import CliRunner

    from prep.cli import main

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny_r1), "-o", str(out), "--engine", engine, "--tp", "1", *flags])
    assert r.exit_code != 0 and message in r.output and not out.exists(), r.output


def _manifest(layout, moe_layout, tp=2, ep=1, engine="atom") -> Manifest:
    return Manifest.from_json({"target": {"layout": layout, "moe_layout": moe_layout, "tp": tp, "ep": ep,
                                          "engine": engine}, "tensors": []})


@pytest.mark.parametrize("backend, arch", [("ck", "gfx950"), ("ck", "gfx942"), ("triton", "gfx950"), ("triton", "gfx942")])
@pytest.mark.parametrize("gemm_path", list(ATOM.gemm_paths))
def test_the_configuration_reading_a_checkpoint_reads_it(gemm_path, backend, arch):
    # prep run's engine_for used to spell this table in reverse; now both directions are one table.
    e = EngineConfig(gemm_path, backend, 2, gpu_arch=arch, profile=ATOM)
    m = _manifest(e.expected_dense_layout(), e.expected_moe_layout())
    back = EngineConfig.reading(m)
    assert (back.expected_dense_layout(), back.expected_moe_layout()) == (m.layout, m.moe_layout)
    assert back.gemm_path == ATOM.gemm_path_reading(m.layout)  # the first path reading it
    check_compatibility(m, back)


def test_the_adapter_keeps_its_old_address():
    import layouts.atom
    import layouts.engines.atom

    assert layouts.atom.install_converted_weights is layouts.engines.atom.install_converted_weights
    assert layouts.get_engine("atom") is layouts.engines.atom.PROFILE
    with pytest.raises(KeyError, match="unknown engine 'tgi'; known: atom, sglang, vllm"):
        layouts.get_engine("tgi")


def test_a_configuration_sent_to_another_process_names_its_engine():
    # The profile object travels by its name (a worker's pickled configuration is that worker's profile's).
    import pickle

    config = EngineConfig.from_env(ATOM, tp_size=2, rank=1, env={})
    back = pickle.loads(pickle.dumps(config))
    assert back == config and back.profile is ATOM


# ------------------------------------------------------------------------------ a second engine
def _no_expert_parallel(manifest, engine):
    return "the toy engine has no expert parallel: convert with --ep 1" if engine.ep_size > 1 else None


class ToyProfile(EngineProfile):
    """An engine whose only GEMM reads the source's byte order and quantizes activations with
    shuffled scales from 16 tokens, never padded; one MoE back end reading the CK layout on gfx95x."""

    name = "toy"
    gemm_paths = {"toy-raw": GemmPathRule(layouts.registry.source_order_layout("dense").name, 16, NEVER)}
    moe_layouts = {("toy-moe", "gfx95"): layouts.registry.MOE_CK.name}
    gpu_archs = (GpuArch("gfx95", "gfx950", "gfx95x (MI355)"),)
    default_gpu_arch = "gfx950"
    expert_parallel_backends = ()
    expert_parallel_switch = "--toy-expert-parallel"
    checks = (*SHARED_CHECKS, _no_expert_parallel)

    def config_from_env(self, env, *, tp_size, rank, ep_size, gpu_arch):
        return EngineConfig(moe_backend="toy-moe", tp_size=tp_size, rank=rank, ep_size=ep_size, gpu_arch=gpu_arch,
                            input_norm_quant_fusion=env.get("TOY_FUSION", "1") == "1", profile=self)


@pytest.fixture
def toy(monkeypatch):
    """The toy engine registered for one test (the known engines restored afterwards)."""
    engines.engine_names()  # the built-in profiles are loaded before the copy
    monkeypatch.setattr(engines, "_PROFILES", dict(engines._PROFILES))
    return layouts.register_engine(ToyProfile())


def test_a_second_engine_plugs_into_the_checks_and_the_activation_flags(toy):
    raw = layouts.registry.source_order_layout("dense").name
    pre = next(n for n in layouts.layout_names("dense") if n != raw)
    ck = layouts.registry.MOE_CK.name
    engine = EngineConfig.from_env(toy, tp_size=2, env={"TOY_FUSION": "0"})
    assert (engine.gemm_path, engine.moe_backend, engine.gpu_arch, engine.input_norm_quant_fusion) == (
        "toy-raw", "toy-moe", "gfx950", False)
    check_compatibility(_manifest(raw, ck, engine="toy"), engine)
    assert EngineConfig.reading(_manifest(raw, ck, engine="toy"), profile=toy) == EngineConfig(
        profile=toy, tp_size=2, moe_backend="toy-moe")
    refusals = {
        (pre, ck, 1): f"checkpoint layout '{pre}' but the toy-raw GEMM reads '{raw}': convert with --layout {raw}",
        (raw, ck, 2): "convert again with --ep 1, or enable --toy-expert-parallel",
        (raw, layouts.registry.MOE_TRITON.name, 1): "toy-moe MoE on gfx950 reads 'ck'; it would compute garbage: "
                                                    "convert with --moe-layout ck",
    }
    for (layout, moe, ep), message in refusals.items():
        with pytest.raises(CompatibilityError) as e:
            check_compatibility(_manifest(layout, moe, ep=ep, engine="toy"), engine)
        assert message in str(e.value)
    with pytest.raises(CompatibilityError, match="the toy engine has no expert parallel"):
        check_compatibility(_manifest(raw, ck, ep=2, engine="toy"), EngineConfig(profile=toy, tp_size=2, ep_size=2))
    with pytest.raises(CompatibilityError, match="GPU arch 'gfx942': prep's .* profile covers gfx95x"):
        EngineConfig(profile=toy, gpu_arch="gfx942")
    assert [tuple(layouts.select_activation_quant(toy.gemm_paths["toy-raw"], m)) for m in (15, 16)] == [
        (False, False), (True, False)]
    plan = layouts.ActivationQuantPlan.for_checkpoint(_manifest(raw, ck, engine="toy"), engine)
    assert tuple(plan.flags(16)) == (True, False) and not plan.input_norm_quant_fusion
    assert toy.inspect_targets() == [(raw, ck)] and "toy" in layouts.engine_names()
    with pytest.raises(CompatibilityError, match="converted for atom, .* convert again with --engine toy"):
        check_compatibility(_manifest(raw, ck), engine)  # ranks written for ATOM hold ATOM's modules
    # ATOM is untouched by the newcomer.
    assert layouts.select_activation_quant(ATOM.gemm_paths["asm"], 1) == (True, True)


def test_a_profile_is_checked_when_it_registers(toy):
    class Clash(ToyProfile):
        name = "clash"
        gemm_paths = {"asm": GemmPathRule(layouts.registry.PRESHUFFLE.name, 32, 32)}  # ATOM's asm has another rule

    with pytest.raises(ValueError, match="GEMM path 'asm' is atom's with another rule"):
        layouts.register_engine(Clash())

    class Unregistered(ToyProfile):
        name = "unregistered"
        gemm_paths = {"toy-w32": GemmPathRule("w32", 0, 0)}

    with pytest.raises(ValueError, match="'w32', which is not a registered dense layout"):
        layouts.register_engine(Unregistered())
    with pytest.raises(ValueError, match="'toy' is already registered"):
        layouts.register_engine(ToyProfile())


# ------------------------------------------------------------------------------ conversion rules
def test_a_second_engine_with_its_own_sharding_rules_gets_ranks_files_of_its_own(toy, tmp_path):
    # The toy engine holds o_proj whole on every rank (ATOM splits its columns) and names its
    # stacked experts differently: converting for it is one --engine, and each rank's files
    # follow its rules, not ATOM's; the manifest says so and ATOM refuses the output.
    from dataclasses import replace

    from layouts.engines import WHOLE, ShardingRules
    from layouts.engines.atom import SHARDING
    from prep.convert import convert
    from prep.deepseek import target_for
    from prep.testing import SynthSpec
    from checkpoints import write_checkpoint

    toy.sharding = ShardingRules(SHARDING.merges, (("deepseek-v3", r"\.self_attn\.o_proj$", WHOLE),), experts="mlp.moe")
    toy.bf16_moe_layout = None
    src = write_checkpoint(SynthSpec(variant="v2"), tmp_path / "src")
    raw = layouts.registry.source_order_layout("dense").name
    ck = layouts.registry.MOE_CK.name
    out = {}
    for engine in ("atom", "toy"):
        convert(str(src), tmp_path / engine,
                target_for(get_engine(engine), layout=raw, moe_layout=ck, tp=2, bf16_moe_layout=None))
        out[engine] = layouts.load_manifest(tmp_path / engine)
    assert out["toy"].target.engine == "toy" and out["atom"].target.engine == "atom"
    # A reader older than target.engine (version 3) would take the toy ranks for ATOM's: it refuses 4.
    assert (out["toy"].format_version, out["atom"].format_version) == (4, 4)
    shapes = {e: {t.name: t.shape for t in m.rank_tensors(0)} for e, m in out.items()}
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert shapes["toy"][o_proj][1] == 2 * shapes["atom"][o_proj][1]  # whole against ATOM's column half
    assert any(".mlp.moe.w13_weight" in n for n in shapes["toy"]) and not any(".mlp.moe." in n for n in shapes["atom"])
    check_compatibility(out["toy"], EngineConfig.reading(out["toy"]))  # the engine it was converted for reads it
    assert o_proj in layouts.load_rank(tmp_path / "toy", 1, verify_hashes=True)
    # verify and revert read the groups the records state, whatever engine's rules made them.
    from prep.revert import revert
    from prep.source import SourceCheckpoint
    from prep.verify import verify

    source = SourceCheckpoint(src)
    assert verify(str(tmp_path / "toy"), str(src))["source_tensors_compared"] == len(source.tensors)
    revert(str(tmp_path / "toy"), tmp_path / "back")
    back = SourceCheckpoint(tmp_path / "back")
    assert all(back.read(n).view(-1).view(torch.uint8).equal(source.read(n).view(-1).view(torch.uint8))
               for n in source.tensors)
    with pytest.raises(CompatibilityError, match="converted for toy.*--engine atom"):
        check_compatibility(out["toy"], EngineConfig.reading(out["toy"], profile=ATOM))


def test_converting_for_an_engine_without_sharding_rules_is_refused_naming_those_with(toy, tmp_path):
    from prep.convert import convert
    from prep.deepseek import engine_of, target_for
    from prep.errors import PrepError
    from prep.testing import SynthSpec
    from checkpoints import write_checkpoint

    src = write_checkpoint(SynthSpec(), tmp_path / "src")
    with pytest.raises(PrepError, match="engine 'toy' states no sharding rules.*--engine atom"):
        convert(str(src), tmp_path / "out", target_for(toy))
    with pytest.raises(PrepError, match="engine 'toy' states no sharding rules.*--engine atom"):
        engine_of("toy")
    assert not (tmp_path / "out").exists()
    with pytest.raises(PrepError, match="unknown engine 'nope'"):
        engine_of("nope")


def test_convert_engine_takes_that_engines_default_layouts(toy, tmp_path):
    # `prep convert --engine toy` with no --layout writes what the toy engine's default
    # configuration reads, not ATOM's defaults (which the toy engine would refuse).
    from dataclasses import replace

    from click.testing import CliRunner

    from layouts.engines.atom import SHARDING
    from prep.cli import main
    from prep.testing import SynthSpec
    from checkpoints import write_checkpoint

    toy.sharding = replace(SHARDING, moe_pad_to=(128, 256), fuse_shared_expert=False)
    src = write_checkpoint(SynthSpec(), tmp_path / "src")
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "out"), "--tp", "2", "--engine", "toy",
                                  "-q"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "out2"), "--tp", "2", "--engine", "toy"])
    assert "prep has no door for toy yet" in r.output and "ATOM" not in r.output, r.output  # not ATOM's command
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "out2")])
    assert r.exit_code == 0 and "deepseek_v3 for toy" in r.output and "serve it with ATOM" not in r.output, r.output
    m = layouts.load_manifest(tmp_path / "out")
    engine = EngineConfig.reading(m)
    assert (m.target.engine, m.layout, m.target.bf16_moe_layout, m.target.inter_pad_to,
            m.target.fuse_shared_expert) == ("toy", layouts.registry.source_order_layout("dense").name, None, 128,
                                             False)
    check_compatibility(m, engine)
    r = CliRunner().invoke(main, ["convert", str(src), "-o", str(tmp_path / "other"), "--engine", "nope"])
    assert r.exit_code != 0 and "unknown engine 'nope'" in r.output and not (tmp_path / "other").exists()
