"""The SSD decoders against pinned outputs: 31 settings of `ssd.generate` (the paper's SSD) and `ssd_carry.generate`
(the default and its variants) on the shipped backbone and drafters, three prompts, per-image seeds. Every code and
every statistic must equal tests/fixtures/ssd_reference.pt (written by tests/fixtures/make_ssd_reference.py), so a
change to the decoders that moves a single draw shows here. A subset runs by default, every setting in the slow run."""
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
try:
    from make_ssd_reference import World, run, settings
finally:
    sys.path.remove(str(FIXTURES))

SETTINGS = settings()
FAST = ("default_b1", "default_batch", "default_stream", "default_stream_per_image", "no_tail", "carry_pointwise",
        "typical", "latent_carried", "paper_batch", "paper_pointwise", "exact_batch")


@pytest.fixture(scope="module")
def world():
    return World()


@pytest.fixture(scope="module")
def reference():
    return torch.load(FIXTURES / "ssd_reference.pt", weights_only=True)


def test_the_fixture_pins_every_setting(reference):
    assert set(reference) == set(SETTINGS)
    assert set(FAST) <= set(SETTINGS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in SETTINGS])
def test_decoder_reproduces_its_pinned_codes_and_stats(name, world, reference, one_thread):
    got, want = run(world, SETTINGS[name]), reference[name]
    assert torch.equal(got["codes"], want["codes"]), name
    assert len(got["stats"]) == len(want["stats"])
    for g, w in zip(got["stats"], want["stats"]):
        assert set(g) == set(w), (name, set(g) ^ set(w))
        for key in w:
            assert torch.equal(g[key], w[key]), (name, key)
