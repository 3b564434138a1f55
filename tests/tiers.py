"""The two tiers of a parametrized test: ``pytest`` runs the fast one, ``-m slow`` the rest."""

import pytest


def tiered(names, slow):
    """``names`` as pytest parameters, those in ``slow`` marked ``slow``."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]
