"""The built-in sharing steps, one module each; importing this package registers them."""

from mutualrl.algorithms.strategies import prp, sgt, xgrpo

__all__ = ["prp", "sgt", "xgrpo"]
