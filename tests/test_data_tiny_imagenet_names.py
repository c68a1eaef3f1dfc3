"""data.tiny_imagenet_names: the wnid -> name table against torchvision's ImageNet-1k categories."""

from __future__ import annotations

from feddifrc_app.data.tiny_imagenet_names import TINY_IMAGENET_CLASS_NAMES, TINY_IMAGENET_WORDS

# The 18 Tiny-ImageNet wnids that are NOT ImageNet-1k synsets -> the ImageNet-1k synset with the same
# first lemma (e.g. n07646821 "goose" is the food synset; ImageNet-1k's goose is n01855672).
TINY_TO_IMAGENET1K: dict[str, str] = {
    "n02666347": "n02666196",
    "n03373237": "n02190166",
    "n04465666": "n04465501",
    "n04598010": "n04597913",
    "n07056680": "n04067472",
    "n07646821": "n01855672",
    "n07647870": "n03250847",
    "n07657664": "n07579787",
    "n07975909": "n02206856",
    "n08496334": "n02730930",
    "n08620881": "n03976657",
    "n08742578": "n02085620",
    "n12520864": "n02906734",
    "n13001041": "n07734744",
    "n13652335": "n03804744",
    "n13652994": "n02999410",
    "n13719102": "n01945685",
    "n14991210": "n07747607",
}


def test_tiny_imagenet_words_table_matches_imagenet_order() -> None:
    """200 sorted wnids; names appear in torchvision's ImageNet-1k categories in wnid order."""
    from torchvision.models import ResNet18_Weights

    wnids = list(TINY_IMAGENET_WORDS)
    assert len(wnids) == 200 == len(set(wnids)) and wnids == sorted(wnids)
    assert TINY_IMAGENET_CLASS_NAMES[0] == "goldfish" and len(set(TINY_IMAGENET_CLASS_NAMES)) == 200
    categories = [c.lower() for c in ResNet18_Weights.IMAGENET1K_V1.meta["categories"]]
    # ImageNet-1k class index order is sorted-wnid order; map the 18 homonym wnids first
    in_1k_order = sorted((TINY_TO_IMAGENET1K.get(w, w), TINY_IMAGENET_WORDS[w]) for w in wnids)
    pos = -1
    for _, name in in_1k_order:
        pos = categories.index(name.lower(), pos + 1)  # ValueError = wrong name or order
