"""Backbones behind one protocol per family (discrete: TokenGrid + DiscreteBackbone; continuous: ContinuousBackbone)."""
from specgen.backbones.protocol import ContinuousBackbone, DiscreteBackbone, TokenGrid
from specgen.backbones.shapes_llama import ShapesLlama

__all__ = ["ContinuousBackbone", "DiscreteBackbone", "ShapesLlama", "TokenGrid"]
