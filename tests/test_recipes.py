"""The recipes together (issue 22): recipes/train_publish.yaml in a real LightningCLI trainer on a
LightningModule that holds a Hugging Face model as ``self.model``, and recipes/rollout.yaml's
loader on the same model class, end bit-exact; the recipes ship inside the package."""
import os
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")

from dcr_testing import assert_bits_equal  # noqa: E402
from nemo_dcr.integrations import DeltaPublishCallback, RolloutLoader, module_snapshot  # noqa: E402
from nemo_dcr.recipes import recipe_path  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", ".*does not have many workers.*")
CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2)


def hf_model():
    torch.manual_seed(0)  # the trainer and the rollout engine start from the same weights
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG))


class Policy(pl.LightningModule):
    """A LightningModule holding a Hugging Face model as ``self.model``, as RL recipes do."""

    def __init__(self):
        super().__init__()
        self.model = hf_model()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CFG["vocab_size"], (12, 8), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def test_the_recipes_ship_in_the_package_and_recipes_dir_still_works():
    for name in ("train_publish.yaml", "rollout.yaml"):
        assert open(recipe_path(name)).read() == open(os.path.join(ROOT, "recipes", name)).read()
    import importlib

    import nemo_dcr.recipes
    assert nemo_dcr.recipes.add_dcr_callback is importlib.import_module("recipes.nemo").add_dcr_callback


def test_train_publish_and_rollout_recipes_work_together(tmp_path):
    from lightning.pytorch.cli import LightningCLI
    store = str(tmp_path / "store")
    cfg = yaml.safe_load(open(recipe_path("train_publish.yaml")))
    (dcr,) = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("DeltaPublishCallback")]
    dcr["init_args"]["store"] = store
    cfg["trainer"].update(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          default_root_dir=str(tmp_path), accelerator="cpu")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cli = LightningCLI(Policy, run=False, args=["--config", str(tmp_path / "cfg.yaml")], save_config_callback=None)
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, DeltaPublishCallback)]
    for k, v in dcr["init_args"].items():
        assert getattr(cb, k) == v, k

    rollout = yaml.safe_load(open(recipe_path("rollout.yaml")))
    engine = hf_model().to(torch.bfloat16)  # the engine loads the trainer's initial checkpoint in bf16
    cli.trainer.fit(cli.model)
    cb.flush()
    loader = RolloutLoader(model_or_tensors=engine, **{**rollout["loader"], "store": store})
    assert loader.version == rollout["loader"]["version"] == 0  # checked against version 0's digest
    v = loader.update()
    assert v == cb.last_published["version"] == 3
    assert loader.last_result.path.startswith("delta")  # only deltas, as the recipe promises
    want = module_snapshot(cli.model.model, dtype="bfloat16")[0]
    got = engine.state_dict()
    assert sorted(want) == sorted(k for k in got if k in want)
    for k, t in want.items():
        assert_bits_equal(got[k], t, k)
