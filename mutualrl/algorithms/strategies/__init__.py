"""The built-in sharing steps, one module each; importing this package registers them."""

from mutualrl.algorithms.strategies import guide, imitate, prp, sgt, xgrpo

__all__ = ["guide", "imitate", "prp", "sgt", "xgrpo"]
