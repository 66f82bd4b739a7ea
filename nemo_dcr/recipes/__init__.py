"""Recipes that ship with the package (a checkout also has them under ``recipes/``):

* ``train_publish.yaml``: a LightningCLI ``trainer.callbacks`` entry for ``DeltaPublishCallback``;
* ``rollout.yaml``: the matching ``RolloutLoader`` arguments and vLLM engine arguments;
* ``nemo.py``: ``add_dcr_callback`` for NeMo 2 recipes.

``recipe_path("train_publish.yaml")`` is where a YAML recipe is installed (for
``python train.py fit --config $(python -c ...)`` or to copy from). The two YAML files are meant
to be used together: the trainer publishes the Hugging Face model a LightningModule holds as
``self.model`` (``submodule: model``), the rollout side loads the same model and follows it.
"""
from __future__ import annotations

import os

from .nemo import add_dcr_callback

RECIPES = ("train_publish.yaml", "rollout.yaml")


def recipe_path(name: str) -> str:
    """The installed path of recipe ``name`` (one of ``RECIPES``)."""
    if name not in RECIPES:
        raise ValueError(f"no recipe {name!r} (recipes: {', '.join(RECIPES)})")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


__all__ = ["add_dcr_callback", "recipe_path", "RECIPES"]
