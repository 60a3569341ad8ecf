"""Harmon behind the continuous protocol on a tiny random release: a Qwen2 folder (transformers' classes) with
a tokenizer, weights in the release's names, the MAR part in MAR's own layout; text conditioning reaches the
head, padded rows equal rows alone, the target accepts itself as draft, and a mismatched config is refused."""
import pytest
import torch
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from specgen.backbones.continuous import ContinuousBackbone
from specgen.backbones.harmon import load_harmon
from specgen.decoding import cspd, mar
from specgen.decoding.sampling import make_rngs
from test_mar_release import kl16_state_dict, mar_state_dict

MAR_SIZES = (32, 2, 1, 4, 16, 2)


def tiny_folder(root, hidden=24, seed=0, weights_name="harmon_1.5b.pth"):
    """config.json + tokenizer files of a 2-layer Qwen2, and the weights (the release's file and parameter names)."""
    torch.manual_seed(seed)
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}  # byte-level BPE without merges
    Qwen2Tokenizer(vocab=vocab, merges=[], pad_token="<|endoftext|>").save_pretrained(root)  # + <|endoftext|>
    config = Qwen2Config(vocab_size=len(vocab) + 1, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.3)  # large: prompts must matter
    config.save_pretrained(root)
    llm = Qwen2ForCausalLM(config).state_dict()
    sd = {f"llm.{k}": v for k, v in llm.items() if k != "lm_head.weight"}  # tied: stored once
    sd.update({f"mar.{k}": v for k, v in mar_state_dict(L=16, seed=seed).items()})
    g = torch.Generator().manual_seed(seed)
    for name, (d_in, d_out) in (("proj_in", (32, hidden)), ("proj_out", (hidden, 32))):
        sd.update({f"{name}.0.weight": 0.3 * torch.randn(hidden, d_in, generator=g), f"{name}.0.bias": torch.zeros(hidden),
                   f"{name}.2.weight": 0.3 * torch.randn(d_out, hidden, generator=g), f"{name}.2.bias": torch.zeros(d_out)})
    torch.save(sd, root / weights_name)
    torch.save({"model": kl16_state_dict(mults=(1, 2, 2), z=3)}, root / "kl16.ckpt")
    return root


def _load(root, **kw):
    opts = dict(mar_sizes=MAR_SIZES, grid_size=4, token_dim=3, buffer_size=8, num_classes=10, sample_steps=5,
                vae_path=str(root / "kl16.ckpt"),
                vae=dict(image_size=16, ch=32, mults=(1, 2, 2), num_res_blocks=1, z_dim=3))
    return load_harmon(str(root), **{**opts, **kw})


def test_harmon_conditions_follow_the_text_and_padded_rows_equal_rows_alone(tmp_path):
    m = _load(tiny_folder(tmp_path))
    assert isinstance(m, ContinuousBackbone) and (m.seq_len, m.token_dim, m.num_steps) == (16, 3, 5)
    prompts = ["a red circle", "two blue squares"]
    conds = m.conditioning(prompts, guided=True)
    assert conds["cond"][0].shape[0] == 2 and conds["null"][1].all()  # one null prompt per image, no padding
    tokens = torch.randn(3, 16, 3)
    unknown = torch.ones(3, 16)
    unknown[0, :5] = 0
    unknown[1, :9] = 0  # rows know 5, 9 and 0 tokens: one padded call
    image = torch.tensor([0, 1, 0])
    zc, zu = m.step_conditions(tokens, unknown, conds, image)
    for r in range(3):
        alone = m.step_conditions(tokens[r:r + 1], unknown[r:r + 1], m.conditioning([prompts[image[r]]], True))
        assert torch.allclose(zc[r], alone[0][0], atol=1e-5) and torch.allclose(zu[r], alone[1][0], atol=1e-5), r
    swapped, _ = m.step_conditions(tokens, unknown, conds, torch.tensor([1, 0, 1]))
    assert not torch.allclose(swapped[0], zc[0], atol=1e-4)  # the prompt reaches the head's conditions


def test_harmon_runs_cspd_and_decodes(tmp_path):
    m = _load(tiny_folder(tmp_path / "t"))
    d = _load(tiny_folder(tmp_path / "d", hidden=16, seed=1))
    prompts = m.prompts(["a red circle", "two blue squares"])
    for ratio in ("paper", "exact"):
        _, st = cspd.generate(m, prompts, make_rngs([0, 1]), m, num_iter=4, gamma=1, prefill_ratio=0.0, ratio=ratio,
                              verify="stepwise", inner_temperature=1.0 if ratio == "paper" else None,
                              prefill_rule="ceil", verify_cfg="own_step", rounds="fixed")
        assert st["accept_rate"] == 1.0, ratio
    out, st = cspd.generate(m, prompts, make_rngs([0, 1]), d, num_iter=4, gamma=2)
    ref, _ = mar.generate(m, prompts, make_rngs([0, 1]), num_iter=4, cfg_schedule="constant")
    assert out.shape == ref.shape == (2, 16, 3) and m.decode(ref).shape == (2, 3, 16, 16)


def test_harmon_loader_refuses_a_mismatched_config_by_key(tmp_path):
    root = tiny_folder(tmp_path)
    with pytest.raises(ValueError, match=r"'mar.fake_latent' has shape \(1, 32\) in the checkpoint, the configured "
                                         r"model has \(1, 48\)"):
        _load(root, mar_sizes=(48, 2, 1, 4, 16, 2))
    cfg = Qwen2Config.from_pretrained(root).to_dict()
    Qwen2Config(**{**cfg, "num_hidden_layers": 3, "layer_types": None}).save_pretrained(root)
    with pytest.raises(ValueError, match=r"no 'llm.model.layers.2.self_attn.q_proj.weight' in the checkpoint.*Qwen2.5 folder"):
        _load(root)
    with pytest.raises(FileNotFoundError, match="no Qwen2 config.json"):
        load_harmon(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"harmon_0.5b.pth' \(in the folder: \['harmon_1.5b.pth'\]\).*"
                                                r"generator.weights"):
        _load(root, size="0.5b")
