"""The SSD decoders against pinned outputs: 31 settings of `ssd.generate` (the paper's SSD) and `ssd_carry.generate`
(the default and its variants) on the shipped backbone and drafters, three prompts, per-image seeds. Every code and
every statistic must equal tests/fixtures/ssd_reference.pt (written by tests/fixtures/make_ssd_reference.py), so a
change to the decoders that moves a single draw shows here. The file holds one table per CPU's kernels (a few near-tied
draws fall differently where kernels round differently); a CPU without a table is held to the table of its capability
(else AVX2's) and a failure names how to write its own. A subset runs by default, every setting in the slow run."""
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
try:
    from make_ssd_reference import World, cpu_kernels, run, settings
finally:
    sys.path.remove(str(FIXTURES))

SETTINGS = settings()
FAST = ("default_b1", "default_batch", "default_stream", "default_stream_per_image", "no_tail", "carry_pointwise",
        "typical", "latent_carried", "paper_batch", "paper_pointwise", "exact_batch")


@pytest.fixture(scope="module")
def world():
    return World()


CPU = cpu_kernels()
FALLBACK = "AVX2"
TABLES = ("AVX2", "AVX512", "AVX512+AMX")
# the settings whose draws fall differently between the tables' CPUs (AVX512 against AVX2: the first two; AMX against
# either: default_bf16 and the last two, carry_tokens also against AVX512)
NEAR_TIES = ("default_bf16", "carry_tokens", "carry_no_lead_bound", "paper_horizontal")


@pytest.fixture(scope="module")
def tables():
    return torch.load(FIXTURES / "ssd_reference.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tables):
    return tables[_key(tables)]


def _key(tables) -> str:
    """This CPU's table, else its capability's (AVX512+AMX -> AVX512), else AVX2's."""
    return next(k for k in (CPU, CPU.split("+")[0], FALLBACK) if k in tables)


def test_the_fixture_pins_every_setting_for_each_cpu(tables):
    assert set(TABLES) <= set(tables)
    for cpu, table in tables.items():
        assert set(table) == set(SETTINGS), (cpu, set(table) ^ set(SETTINGS))
    assert set(FAST) <= set(SETTINGS)


def test_the_cpus_tables_differ_only_in_the_named_near_ties(tables):
    """A table rewritten to hide a change of the decoders would differ from the other CPUs' in more settings."""
    differ = set()
    for i, a in enumerate(TABLES):
        for b in TABLES[i + 1:]:
            pair = {n for n in SETTINGS if not torch.equal(tables[a][n]["codes"], tables[b][n]["codes"])}
            assert pair <= set(NEAR_TIES), (a, b, pair - set(NEAR_TIES))
            differ |= pair
    assert differ == set(NEAR_TIES)


def _fix(name: str) -> str:
    key = _key(torch.load(FIXTURES / "ssd_reference.pt", weights_only=True))
    table = key if key == CPU else f"{key} (this CPU, {CPU}, has no table of its own)"
    return (f"{name} differs from the {table} table; if the decoders did not change, write this CPU's table with "
            f"`python tests/fixtures/make_ssd_reference.py tests/fixtures/ssd_reference.pt {name}`")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in SETTINGS])
def test_decoder_reproduces_its_pinned_codes_and_stats(name, world, reference, one_thread):
    got, want = run(world, SETTINGS[name]), reference[name]
    assert torch.equal(got["codes"], want["codes"]), _fix(name)
    assert len(got["stats"]) == len(want["stats"])
    for g, w in zip(got["stats"], want["stats"]):
        assert set(g) == set(w), (name, set(g) ^ set(w))
        for key in w:
            assert torch.equal(g[key], w[key]), (key, _fix(name))
