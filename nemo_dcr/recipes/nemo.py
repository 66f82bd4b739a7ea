"""NeMo 2 recipes: add the delta-publishing callback to a recipe's trainer.

    from nemo.collections import llm
    import nemo_run as run
    from nemo_dcr.recipes import add_dcr_callback    # (a checkout: recipes.nemo too) or copy this function

    recipe = llm.llama3_8b.pretrain_recipe(name="run1", num_nodes=1, num_gpus_per_node=8)
    add_dcr_callback(recipe, store="s3://my-bucket/runs/run1", every_n_steps=1, dtype="bfloat16")
    run.run(recipe)

The callback publishes a Megatron model's shards jointly from every rank
(``nemo_dcr.callbacks.megatron``); its arguments are those of ``DeltaPublishCallback``.
"""
from __future__ import annotations


def add_dcr_callback(recipe, store: str, config_cls=None, **kwargs):
    """Append ``run.Config(DeltaPublishCallback, store=store, **kwargs)`` to
    ``recipe.trainer.callbacks`` (created if None) and return the recipe. ``config_cls``
    defaults to ``nemo_run.Config`` (imported only here)."""
    from nemo_dcr.integrations import DeltaPublishCallback

    if config_cls is None:
        import nemo_run as run

        config_cls = run.Config
    cb = config_cls(DeltaPublishCallback, store=store, **kwargs)
    if getattr(recipe.trainer, "callbacks", None) is None:
        recipe.trainer.callbacks = []
    recipe.trainer.callbacks.append(cb)
    return recipe
