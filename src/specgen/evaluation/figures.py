"""The figures a run writes, from its flat metrics and its images.

- `pareto_png`: quality against target passes saved and against wall-clock speed-up, one point per strategy with
  its 95% intervals, the non-dominated strategies joined (the Pareto front).
- `sweep_png`: one swept setting (SSD's verification rounds, CSpD's draft length, ...) on the x axis: pass ratio
  per batch size and quality, each with its interval.
- `accept_maps_png`: the first-pass acceptance map of every speculative strategy side by side.
- `alpha_steps_png`: CSpD's acceptance rate along the generation steps.
- `captioned_grid`: sample images with their prompts under them.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from specgen.utils.plots import pyplot


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (higher is better on both), by ascending x."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i][0])


def _quality(metrics: dict[str, float], name: str, key: str) -> tuple[float, float] | None:
    q = metrics.get(f"{name}/{key}")
    return None if q is None else (q, metrics.get(f"{name}/{key}_ci95", 0.0))


def pareto_png(metrics: dict[str, float], names: list[str], path: str | Path, batch_size: int,
               quality_key: str = "geneval/overall") -> bool:
    """Quality (95% interval) against the pass ratio and the wall-clock ratio at `batch_size` over the first
    strategy (the reference); the Pareto front of each panel is drawn as a line. False when nothing to plot."""
    axes_keys = [(f"speed/nfe_ratio_bs{batch_size}", "target passes saved (x fewer than {ref})"),
                 (f"speed/wall_ratio_bs{batch_size}", "wall-clock speed-up over {ref}")]
    panels = []
    for xkey, label in axes_keys:
        pts = [(n, metrics[f"{n}/{xkey}"], *_quality(metrics, n, quality_key)) for n in names
               if f"{n}/{xkey}" in metrics and _quality(metrics, n, quality_key) is not None]
        if pts:
            panels.append((xkey, label, pts))
    if not panels:
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), dpi=120, squeeze=False)
    for ax, (xkey, label, pts) in zip(axes[0], panels):
        ref_q, ref_ci = _quality(metrics, names[0], quality_key) or (None, None)
        if ref_q is not None:  # the reference's quality band: a strategy inside it keeps the reference's quality
            ax.axhspan(ref_q - ref_ci, ref_q + ref_ci, color="0.85", zorder=0, label=f"{names[0]} (95%)")
        for n, x, y, ci in pts:
            ax.errorbar([x], [y], yerr=[ci], fmt="o", capsize=3, ms=4)
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        front = pareto_front([(x, y) for _, x, y, _ in pts])
        ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], "--", color="tab:red", lw=1,
                label="Pareto front")
        ax.set_xlabel(label.format(ref=names[0]) + f", batch {batch_size}")
        ax.set_ylabel(f"{quality_key} (95% interval)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def sweep_png(metrics: dict[str, float], series: dict[str, float], xlabel: str, path: str | Path,
              batch_sizes: list[int], quality_key: str = "geneval/overall", ref: str | None = None) -> bool:
    """A swept setting: `series` maps strategy name -> its x value. Left: pass ratio at each batch size (95%
    interval where the run measured one); right: quality with its interval, the reference's as a band."""
    if len(series) < 2:
        return False
    names = sorted(series, key=lambda n: series[n])
    xs = [series[n] for n in names]
    plt = pyplot()
    has_q = any(f"{n}/{quality_key}" in metrics for n in names)
    fig, axes = plt.subplots(1, 2 if has_q else 1, figsize=(10 if has_q else 5, 3.8), dpi=120, squeeze=False)
    ax = axes[0][0]
    for bs in batch_sizes:
        ys = [metrics.get(f"{n}/speed/nfe_ratio_bs{bs}", np.nan) for n in names]
        ci = [metrics.get(f"{n}/speed/nfe_ratio_ci95_bs{bs}", 0.0) for n in names]
        ax.errorbar(xs, ys, yerr=ci, fmt="o-", capsize=3, ms=4, label=f"batch {bs}")
    ax.set_xticks(xs)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"target passes saved (x fewer than {ref or 'reference'})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_q:
        ax = axes[0][1]
        q = [_quality(metrics, n, quality_key) or (np.nan, 0.0) for n in names]
        ax.errorbar(xs, [v for v, _ in q], yerr=[c for _, c in q], fmt="o-", capsize=3, ms=4, color="tab:green")
        ref_q = _quality(metrics, ref, quality_key) if ref else None
        if ref_q is not None:
            ax.axhspan(ref_q[0] - ref_q[1], ref_q[0] + ref_q[1], color="0.85", zorder=0, label=f"{ref} (95%)")
            ax.legend(fontsize=8)
        ax.set_xticks(xs)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{quality_key} (95% interval)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def acceptance_map_png(m: np.ndarray, path: str | Path, title: str) -> None:
    """Heat map of the per-position acceptance rate (H, W), written as a PNG."""
    accept_maps_png({title: m}, path)


def accept_maps_png(maps: dict[str, np.ndarray], path: str | Path, ncols: int = 4) -> None:
    """Per-position first-pass acceptance (H, W) of each strategy, side by side on one colour scale."""
    plt = pyplot()
    ncols = min(ncols, len(maps))
    nrows = -(-len(maps) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols + 0.6, 3.3 * nrows), dpi=120, squeeze=False)
    for ax in axes.flat[len(maps):]:
        ax.axis("off")
    for ax, (title, m) in zip(axes.flat, maps.items()):
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(f"{title} (mean {float(np.mean(m)):.2f})", fontsize=8)
        ax.set_xlabel("column")
        ax.set_ylabel("row")
    fig.colorbar(im, ax=list(axes.flat), fraction=0.046 / ncols, label="first-pass acceptance")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def alpha_steps_png(metrics: dict[str, float], names: list[str], path: str | Path) -> None:
    """Acceptance rate along the generation steps, one line per strategy that drafts."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=120)
    for n in names:
        pts = sorted((int(k.rsplit("/s", 1)[1]), v) for k, v in metrics.items() if k.startswith(f"{n}/alpha_by_step/"))
        if pts:
            ax.plot([p[0] + 1 for p in pts], [p[1] for p in pts], "o-", ms=3, label=n)
    ax.set_xlabel("MAR generation step")
    ax.set_ylabel("acceptance rate alpha")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def captioned_grid(images: list[np.ndarray], captions: list[str], ncols: int = 6, scale: int = 3,
                   lines: int = 4, pad: int = 4) -> np.ndarray:
    """uint8 (S, S, 3) images upscaled by `scale`, each with its caption wrapped under it (at most `lines` lines,
    the last one ellipsised): a sample grid a reader can check against its prompts."""
    if len(images) != len(captions):
        raise ValueError(f"{len(images)} images but {len(captions)} captions: give one caption per image")
    font = ImageFont.load_default()
    side = images[0].shape[0] * scale
    char_w = max(1.0, font.getlength("a photo of two red circles") / 26)  # a prompt's mean character width
    line_h = int(sum(abs(v) for v in font.getbbox("Mg")[1::2])) + 2
    width_chars = max(8, int(side // char_w) - 1)
    cell_h = side + lines * line_h + pad
    nrows = -(-len(images) // ncols)
    canvas = Image.new("RGB", (ncols * (side + pad) + pad, nrows * (cell_h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (img, text) in enumerate(zip(images, captions)):
        r, c = divmod(i, ncols)
        x, y = pad + c * (side + pad), pad + r * (cell_h + pad)
        canvas.paste(Image.fromarray(img).resize((side, side), Image.NEAREST), (x, y))
        wrapped = textwrap.wrap(text, width_chars) or [""]
        if len(wrapped) > lines:
            wrapped = wrapped[: lines - 1] + [textwrap.shorten(" ".join(wrapped[lines - 1:]), width_chars, placeholder="...")]
        for k, line in enumerate(wrapped):
            draw.text((x, y + side + 2 + k * line_h), line, fill="black", font=font)
    return np.asarray(canvas)
