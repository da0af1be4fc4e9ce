"""Help texts built from the registries only when a help page is printed (no torch import for
`verispec --help`): a help string may name `{drafters}`, replaced by one line per registered
drafter kind."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _expand_help(self, action):
        text = super()._expand_help(action)
        if "{drafters}" in text:
            from .drafters import drafter_help

            text = text.replace("{drafters}", drafter_help())
        return text


DRAFTER_HELP = "the drafter: {drafters}"
TREE_HELP = ("draft shape: chain, dynamic[:W] (n-gram trie / best-first, at most W children per node, default 4) or "
             "static:B1,B2,.. (children per node at each depth); -k is then the node budget")
