"""The built-in sharing steps, one module each; importing this package registers them."""

from mutualrl.algorithms.strategies import distill, guide, imitate, prp, sgt, xgrpo

__all__ = ["distill", "guide", "imitate", "prp", "sgt", "xgrpo"]
