"""GRPO, the sharing strategies and the update.

Importing this package registers the built-in strategy steps (:mod:`mutualrl.algorithms.strategies`)
in the registry of :mod:`mutualrl.algorithms.sharing`, so every user of the registry sees them.
"""

from mutualrl.algorithms import strategies  # noqa: F401  (registers the built-in steps)
