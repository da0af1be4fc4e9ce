"""Drafters: every kind behind the one `Drafter` interface and registry (base.py), one file each.
Importing this package registers them all."""

from __future__ import annotations

from .base import CHAIN, Draft, Drafter, DrafterBase, DrafterContext, TreeShape, drafter_help, make_drafter, register
from . import ngram, model_drafter, eagle3, mtp, peagle, dflash, dspark, hybrid  # noqa: F401,E402  (each registers its kinds)
from .model_drafter import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["CHAIN", "Draft", "Drafter", "DrafterBase", "DrafterContext", "ModelDrafter", "NgramDrafter", "TreeShape",
           "drafter_help", "make_drafter", "register"]
