"""Image tokenizers: VQ (discrete codes) and KL (continuous latents) autoencoders."""
from specgen.tokenizers.vq import VQAutoencoder

__all__ = ["VQAutoencoder"]
