"""`--compute model`: the tiny video transformer trains on a padded batch (CPU, small clips)."""

import torch

from helix_bench.model import ModelCompute, TinyVideoTransformer


def test_tiny_model_forward_shapes_and_token_cost():
    m = TinyVideoTransformer(dim=32, depth=1, heads=2, classes=10)
    out = m(torch.randint(0, 256, (2, 4, 3, 32, 48), dtype=torch.uint8))
    assert out.shape == (2, 10)


def test_model_step_updates_weights():
    step = ModelCompute("cpu", seed=1)
    before = [p.detach().clone() for p in step.model.parameters()]
    batch = {"video": torch.randint(0, 256, (2, 5, 3, 40, 40), dtype=torch.uint8), "label": torch.tensor([3, -1])}
    assert step(batch) > 0  # odd T and sizes are cropped to the tubelet grid; -1 labels clamp to 0
    step.opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, step.model.parameters()))
    again = ModelCompute("cpu", seed=1)  # every rank starts from the same weights
    assert all(torch.equal(a, p) for a, p in zip(before, again.model.parameters()))
