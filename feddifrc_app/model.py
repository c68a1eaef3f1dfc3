"""The client classifier: ResNet-10 of the paper.

``forward(x)`` returns ``(features, logits)``: ``features`` is the pooled embedding ``z``
(``8 * width``-d: 512 at the paper's width 64) that TDCL/NDCR pull towards the diffusion
teacher, ``logits`` is ``fc(features)``. No max-pool and a stride-1 3x3 stem: the CIFAR-style
variant of ``model/resnet_cnn.py`` in the public code, so a 32x32 input reaches the last stage
at 4x4. Works for any input size >= 8 (global average pool). Hand-written rather than
torchvision's ``ResNet``/``BasicBlock``: its 7x7 stem, max-pool, fixed width and state-dict
names (``downsample``, not ``shortcut``) differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from feddifrc_app.config import RESNET10_STRIDES


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 conv-BN) shortcut.

    (B, c_in, H, W) -> (B, c_out, ceil(H/stride), ceil(W/stride)).
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        # Projection only when the shape changes; otherwise a true identity.
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet10(nn.Module):
    """ResNet-10: stem + four stages of ONE BasicBlock (w/2w/4w/8w, strides 1/2/2/2).

    ``width`` w = 64 is the paper's network: input (B, 3, S, S) float -> (features (B, 512),
    logits (B, num_classes)), 4,903,242 parameters for 10 classes. w = 16 (128-d features,
    308,826 parameters) is ~8x cheaper on a CPU and enough for 28x28 digits.
    """

    strides: tuple[int, ...] = RESNET10_STRIDES  # config.last_stage_size reads the same strides

    def __init__(self, num_classes: int, width: int = 64) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes}: expected >= 1")
        if width < 1:
            raise ValueError(f"width={width}: expected >= 1")
        self.num_classes = num_classes
        self.widths = (width, 2 * width, 4 * width, 8 * width)
        self.embedding_dim = 8 * width
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        blocks = []
        c_in = width
        for c_out, stride in zip(self.widths, self.strides, strict=True):
            blocks.append(BasicBlock(c_in, c_out, stride))
            c_in = c_out
        self.layer1, self.layer2, self.layer3, self.layer4 = blocks
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.embedding_dim, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # torchvision's ResNet initialisation (He-normal convs, unit BN).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) -> pooled pre-classifier features (B, 8 * width)."""
        out = self.stem(x)
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(self.pool(out), 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.embed(x)
        return features, self.fc(features)


MODELS: dict[str, type[ResNet10]] = {"resnet10": ResNet10}


def build_model(
    name: str, num_classes: int, width: int = 64, head: Callable[[int, int], nn.Module] | None = None
) -> nn.Module:
    """A fresh classifier by name (``MODELS``) and base width; unknown names raise ``ValueError``.
    ``head(embedding_dim, num_classes)``: a method's classifier head in place of the linear one
    (built after the network, so the network's initial weights are the same either way)."""
    try:
        cls = MODELS[name]
    except KeyError:
        raise ValueError(f"model name={name!r}: expected one of {', '.join(MODELS)}") from None
    model = cls(num_classes, width)
    if head is not None:
        model.fc = head(model.embedding_dim, num_classes)
    return model


def load_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a global state dict; only BN's num_batches_tracked may be absent (it never travels:
    it is unused with a set BN momentum and breaks FedOpt's float maths).

    ``strict=False`` alone would silently keep random weights for any key the state misses
    (e.g. renamed keys) and train/evaluate a fresh model.
    """
    res = model.load_state_dict(state, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or res.unexpected_keys:
        raise ValueError(
            f"the received arrays do not match the {type(model).__name__} state dict: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {res.unexpected_keys[:5]}{'...' if len(res.unexpected_keys) > 5 else ''}"
        )
