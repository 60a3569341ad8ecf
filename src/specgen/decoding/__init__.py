"""Decoding strategies: tensors in, tensors out, one file per algorithm (shared pieces: `sampling`, `state`,
`spec1d`, `cspd_core`). Strategies are chosen by config (`configs/decoding/<name>.yaml` names the function and
binds its options); there is no registry in code.

Two call shapes, one per backbone family, and one result shape:

    discrete (ar, ssd, sjd, zipar, mtp1d, specdec), over `backbones.protocol.DiscreteBackbone`:
        generate(backbone, prompts (backbones.protocol.Prompts), [drafter,] cfg_scale=, temperature=, top_k=,
                 rngs=, **options)
            -> (codes (B, H, W), stats)
    continuous (mar, cspd), over `backbones.continuous.ContinuousBackbone` (MAR, xAR, Harmon, embedded MAR):
        generate(backbone, prompts: list[str], rngs, [draft,] num_iter=, cfg_scale=, **options)
            -> (tokens (B, L, d), stats)

Both are called as `fn(backbone, backbone.prompts(texts), rngs=...)` by the evaluation runner (a
continuous backbone's `prompts` returns the validated texts, or class ids) and decoded by `backbone.decode`.
`stats` is a dict of per-image statistics, each a number for the batch or a (B,) tensor (`nfe`, acceptance
counts, ...); `evaluation.generate` splits it per image.
"""
