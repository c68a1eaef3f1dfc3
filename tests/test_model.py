"""ResNet-10: shapes, parameter count, features = pooled pre-linear vector."""

from __future__ import annotations

import pytest
import torch

from feddifrc_app.model import MODELS, ResNet10, build_model


@pytest.mark.parametrize("size, last_hw", [(32, 4), (64, 8)])
def test_output_shapes(size: int, last_hw: int) -> None:
    torch.manual_seed(0)
    model = build_model("resnet10", 10).eval()
    seen: dict[str, torch.Size] = {}

    def hook(module: torch.nn.Module, inputs: object, output: torch.Tensor) -> None:
        seen["layer4"] = output.shape

    model.layer4.register_forward_hook(hook)
    with torch.no_grad():
        features, logits = model(torch.randn(2, 3, size, size))
    assert features.shape == (2, 512)
    assert logits.shape == (2, 10)
    # stride-1 stem, no max-pool, strides 1/2/2/2 -> S/8 at the last stage
    assert seen["layer4"] == (2, 512, last_hw, last_hw)


def test_parameter_count_is_papers_4_90m() -> None:
    n = sum(p.numel() for p in build_model("resnet10", 10).parameters())
    # stem 1,728+128; blocks 73,984 / 230,144 / 919,040 / 3,673,088 (with 1x1 shortcuts); fc 5,130
    assert n == 4_903_242
    assert round(n / 1e6, 2) == 4.90
    n100 = sum(p.numel() for p in build_model("resnet10", 100).parameters())
    assert n100 - n == 90 * 513  # only the classifier grows


def test_features_are_pooled_pre_linear_vector() -> None:
    torch.manual_seed(0)
    model = build_model("resnet10", 7).eval()
    captured: list[torch.Tensor] = []
    model.layer4.register_forward_hook(lambda m, i, o: captured.append(o))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        features, logits = model(x)
        assert torch.allclose(features, captured[0].mean(dim=(2, 3)), atol=1e-6)
        assert torch.allclose(logits, model.fc(features), atol=1e-6)
    assert torch.equal(features, torch.relu(features))  # post-ReLU pooled activations


def test_structure_and_shortcuts() -> None:
    model = ResNet10(10)
    assert model.embedding_dim == 512 and model.widths == (64, 128, 256, 512)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    stem_conv = model.stem[0]
    assert (stem_conv.kernel_size, stem_conv.stride, stem_conv.out_channels) == ((3, 3), (1, 1), 64)
    # identity shortcut only where the shape is unchanged (layer1), 1x1 conv + BN elsewhere
    assert isinstance(model.layer1.shortcut, torch.nn.Identity)
    for layer, width in ((model.layer2, 128), (model.layer3, 256), (model.layer4, 512)):
        conv, bn = layer.shortcut
        assert conv.kernel_size == (1, 1) and conv.stride == (2, 2) and conv.out_channels == width
        assert isinstance(bn, torch.nn.BatchNorm2d)


def test_gradient_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = build_model("resnet10", 10).train()
    _, logits = model(torch.randn(4, 3, 16, 16))
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 3])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_model_name_lists_choices() -> None:
    assert list(MODELS) == ["resnet10"]
    with pytest.raises(ValueError, match="resnet10"):
        build_model("resnet18", 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet10", 0)


def test_load_weights_accepts_missing_bn_counters_only():
    from feddifrc_app.model import build_model, load_weights

    src, dst = build_model("resnet10", 10), build_model("resnet10", 10)
    state = {k: v for k, v in src.state_dict().items() if not k.endswith("num_batches_tracked")}
    load_weights(dst, state)
    assert torch.equal(dst.fc.weight, src.fc.weight)
    with pytest.raises(ValueError, match="missing"):
        load_weights(dst, {k: v for k, v in state.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="unexpected"):
        load_weights(dst, {**state, "module.extra": torch.zeros(1)})


def test_width_scales_the_network_and_the_embedding() -> None:
    narrow = build_model("resnet10", 10, width=16).eval()
    assert narrow.embedding_dim == 128 and narrow.widths == (16, 32, 64, 128)
    assert sum(p.numel() for p in narrow.parameters()) == 308_826
    z, logits = narrow(torch.randn(2, 3, 28, 28))
    assert z.shape == (2, 128) and logits.shape == (2, 10)
    with pytest.raises(ValueError, match="width=0"):
        build_model("resnet10", 10, width=0)


@pytest.mark.parametrize("size", [8, 9, 15, 16, 17, 28, 32])
def test_last_stage_size_is_the_models(size):
    from feddifrc_app.config import last_stage_size

    m = ResNet10(10, width=4).eval()
    with torch.no_grad():
        out = m.layer4(m.layer3(m.layer2(m.layer1(m.stem(torch.zeros(1, 3, size, size))))))
    assert out.shape[-2:] == (last_stage_size(size), last_stage_size(size))
