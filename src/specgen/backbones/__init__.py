"""Backbones behind one protocol per family (discrete: TokenGrid + DiscreteBackbone)."""
from specgen.backbones.protocol import DiscreteBackbone, TokenGrid
from specgen.backbones.shapes_llama import ShapesLlama

__all__ = ["DiscreteBackbone", "ShapesLlama", "TokenGrid"]
