"""The parts of MAR, xAR and Harmon that are easy to get wrong, pinned to values computed by hand from the authors'
code (experiments/real_backbones/README.md has the file-to-file table): MAR's cosine mask schedule and linear CFG
schedule, its last step included (LTH14/mar models/mar.py `sample_tokens`; CSpD's verification scale), the diffusion
head's temperature (its `p_sample`: the noise times the temperature), Harmon's prompts (wusize/Harmon
scripts/batch_text2image.py with xtuner's qwen_chat template). The KL-16 scale (0.2325) and xAR's flow step are
pinned in tests/test_mar_release.py and tests/test_xar.py."""
import math

import pytest
import torch

from specgen.backbones.continuous import cosine_schedule
from specgen.decoding.cspd_core import tempered
from specgen.decoding.mar import cfg_at


def authors_schedule(L: int, n: int) -> list[int]:
    """Tokens known after each step, transcribed from `sample_tokens`: mask_len = floor(L cos(pi/2 (s+1)/n)),
    clamped to [1, masked - 1]; the last step predicts every token still masked."""
    known, out = 0, []
    for s in range(n):
        mask_len = max(1, min(L - known - 1, math.floor(L * math.cos(math.pi / 2 * (s + 1) / n))))
        known = L if s == n - 1 else L - mask_len
        out.append(known)
    return out


def test_mar_cosine_schedule_equals_the_authors_loop():
    # by hand: 16 cos(pi/8) = 14.78 -> 14 masked (2 known), 16 cos(pi/4) = 11.31 -> 5 known, 16 cos(3pi/8) = 6.12
    # -> 10 known, then all 16; at 4 tokens and 4 steps the clamp leaves one token a step, as at MAR's first
    # steps (256 cos(pi/128) = 255.9: the clamp to masked - 1 reveals one token a step)
    assert cosine_schedule(16, 4) == [2, 5, 10, 16] and cosine_schedule(4, 4) == [1, 2, 3, 4]
    assert cosine_schedule(256, 64)[:3] == [1, 2, 3] and cosine_schedule(256, 64)[-3:] == [244, 250, 256]
    assert all(cosine_schedule(L, n) == authors_schedule(L, n) for L in range(1, 70) for n in range(1, L + 1))


def test_mar_linear_cfg_before_the_last_step_equals_the_authors_formula():
    # cfg_iter = 1 + (cfg - 1) (L - mask_len) / L, mask_len = the tokens still masked after the step
    assert [cfg_at(3.0, "linear", k, 16) for k in (2, 5, 10)] == [1.25, 1.625, 2.25]
    assert cfg_at(2.9, "linear", 1, 256) == pytest.approx(1 + 1.9 / 256)


def test_mar_linear_cfg_of_the_last_step_equals_the_authors_clamped_formula():
    # the last step predicts every masked token, but its mask_len is clamped to 1: 1 + (cfg - 1)(L - 1)/L
    assert cfg_at(3.0, "linear", 16, 16) == pytest.approx(1 + 2.0 * 15 / 16)  # 2.875, not 3.0
    assert cfg_at(2.9, "linear", 256, 256) == pytest.approx(1 + 1.9 * 255 / 256)  # MAR-B's 2.9: 2.8926
    assert cfg_at(3.0, "linear", 1, 1) == 1.0  # one token: their mask_len is 1 and L - 1 = 0
    scales = [cfg_at(3.0, "linear", k, 16) for k in authors_schedule(16, 4)]
    assert scales == [1 + 2.0 * min(k, 15) / 16 for k in (2, 5, 10, 16)]  # the authors' loop's cfg_iter each step
    # the named alternative keeps the unclamped formula: the full scale at the last step, equal before it
    assert cfg_at(3.0, "linear_full", 16, 16) == 3.0
    assert [cfg_at(3.0, "linear_full", k, 16) for k in (2, 5, 10)] == [1.25, 1.625, 2.25]


def test_cspd_verification_scale_of_the_last_round_follows_the_clamped_schedule():
    """CSpD's authors verify a round at the scale of its last drafted step (their `draft_aux['mask_len']`, the
    same clamp): a round that ends at the last step is verified at 1 + (cfg - 1)(L - 1)/L, and so is every
    token of that round under verify_cfg="round_last"; own_step keeps each drafted step's own scale."""
    from specgen.decoding import cspd
    from specgen.decoding.sampling import make_rngs
    from test_cspd_decoding import PROMPTS, _tiny_mar

    target, draft = _tiny_mar(0), _tiny_mar(1)
    for verify_cfg, schedule in (("round_last", "linear"), ("own_step", "linear"), ("round_last", "linear_full")):
        s = cspd.start(target, draft, PROMPTS, make_rngs([3, 4]), 4, 3.0, schedule)
        drafted, d_tokens = cspd.draft_steps(s, s.st.schedule)  # one round: every step drafted
        _, _, scale = cspd.target_view(s, drafted, d_tokens, stepwise=False, round_cfg=verify_cfg == "round_last")
        want = [cfg_at(3.0, schedule, d.end, 16) for d in drafted]
        if verify_cfg == "round_last":
            want = [want[-1]] * len(drafted)
        per_token = [w for w, d in zip(want, drafted) for _ in range(len(d.idx[0]))]
        assert scale.tolist() == pytest.approx(per_token), (verify_cfg, schedule)
        assert scale[-1].item() == pytest.approx(2.875 if schedule == "linear" else 3.0)


def test_head_temperature_scales_the_noise_as_the_authors_p_sample():
    # p_sample: mean + exp(0.5 log_var) * noise * temperature -> the variance times temperature^2
    step = tempered(lambda x, i: (x + 1.0, torch.full_like(x, 4.0)), 0.5)
    mean, var = step(torch.zeros(3), 0)
    assert torch.equal(mean, torch.ones(3)) and torch.equal(var, torch.ones(3))


def test_harmon_prompts_are_its_scripts(tmp_path):
    from test_harmon import _load, tiny_folder

    m = _load(tiny_folder(tmp_path))
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # xtuner's PROMPT_TEMPLATE.qwen_chat
    cond = m.conditioning([" a red apple "], guided=True)
    want = m.tokenizer([chat.format("Generate an image: a red apple."), chat.format("Generate an image.")],
                       padding=True, return_tensors="pt")
    ids, mask = cond["cond"]
    null_ids, null_mask = cond["null"]
    n, k = int(mask.sum()), int(null_mask.sum())
    assert ids[0, :n].tolist() == want["input_ids"][0][want["attention_mask"][0].bool()].tolist()
    assert null_ids[0, :k].tolist() == want["input_ids"][1][want["attention_mask"][1].bool()].tolist()
    assert m.tokenizer.padding_side == "right"  # the config's padding_side


def test_xar_sizes_and_sampling_settings_are_the_releases():
    # OliverRensu/xAR models/xar.py xar_base/large/huge (width, encoder depth, decoder depth, heads) and its README's
    # evaluation commands (--num_steps, --cfg)
    from specgen.backbones import xar

    assert xar.PRESETS == {"base": (768, 8, 8, 12), "large": (1024, 16, 16, 16), "huge": (1280, 20, 20, 16)}
    assert xar.PAPER == {"base": (40, 2.7), "large": (50, 2.3), "huge": (50, 2.2)} and xar.T_LAST == 0.04
    assert [cfg_at(2.3, "linear_steps", k, 4, [1, 2, 3, 4]) for k in (1, 4)] == pytest.approx([1.0, 2.3])  # cells 0, 3
