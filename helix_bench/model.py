"""``--compute model``: a real (tiny) video transformer's forward and backward instead of a sleep.

Tubelets of 2x16x16 pixels are embedded, run through a small pre-norm transformer (PyTorch's
``scaled_dot_product_attention``, so cost grows with tokens like the real models), pooled and
classified; gradients are averaged over the ranks with an all_reduce (that is the sync wait). For
GPU machines (``device="cuda"``); on a CPU it works, slowly, on small clips.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelCompute", "TinyVideoTransformer"]


class TinyVideoTransformer(nn.Module):
    """A VideoMAE-like classifier: tubelet (2, 16, 16) embedding, ``depth`` blocks of width ``dim``."""

    def __init__(self, dim: int = 64, depth: int = 2, heads: int = 4, classes: int = 400, max_tokens: int = 65536):
        super().__init__()
        self.embed = nn.Conv3d(3, dim, kernel_size=(2, 16, 16), stride=(2, 16, 16))
        self.pos = nn.Parameter(torch.zeros(1, max_tokens, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, classes)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """``video``: uint8 [B, T, 3, H, W] (T even, H, W multiples of 16) -> logits [B, classes]."""
        x = video.permute(0, 2, 1, 3, 4).float().div_(255.0)  # [B, 3, T, H, W]
        x = self.embed(x).flatten(2).transpose(1, 2)  # [B, tokens, dim]
        x = x + self.pos[:, : x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


class ModelCompute:
    """One training step of the tiny model on a rank's batch; returns its wall seconds."""

    def __init__(self, device: str = "cpu", seed: int = 0):
        torch.manual_seed(seed)  # every rank starts from the same weights, as DDP would
        self.device = torch.device(device)
        self.model = TinyVideoTransformer().to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, batch: dict) -> float:
        t0 = time.perf_counter()
        video = batch["video"].to(self.device, non_blocking=True)
        t, h, w = video.shape[1] // 2 * 2, video.shape[3] // 16 * 16, video.shape[4] // 16 * 16
        video = video[:, :t, :, :h, :w]
        labels = batch.get("label", torch.zeros(video.shape[0], dtype=torch.int64)).clamp(min=0).to(self.device)
        loss = F.cross_entropy(self.model(video), labels % self.model.head.out_features)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self._sync()
        return time.perf_counter() - t0

    def all_reduce_grads(self) -> None:
        """Average gradients over the process group (gloo: through host memory), then step."""
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).cpu()
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.opt.step()
