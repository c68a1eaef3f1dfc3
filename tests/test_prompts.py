"""prompts.py: the teacher's prompt list of each method, in the order the feature-cache key uses."""

from __future__ import annotations

from conftest import make_config

from feddifrc_app.methods.feddifrc.teacher import teacher_prompts


def test_teacher_prompts():
    cfg = make_config()
    names = ["zero", "one", "two"]
    assert teacher_prompts(cfg, names) == ("a photo of a zero", "a photo of a one", "a photo of a two", "")
    ssl = make_config(method="feddifrc-ssl", ssl__num_negatives=3)
    p = teacher_prompts(ssl, names, negative_pool=["cat", "dog", "emu", "fox", "gnu"])
    assert p[0] == "a photo of a similar object" and p[-1] == "a photo of a visual object"
    assert len(p) == 5 and all(x.startswith("a photo of a ") for x in p[1:4])
    assert p == teacher_prompts(ssl, [], negative_pool=["cat", "dog", "emu", "fox", "gnu"])  # seeded
    default = teacher_prompts(ssl, [])
    assert len(default) == 5
    explicit = make_config(method="feddifrc-ssl", ssl__negatives="cat,dog")
    assert teacher_prompts(explicit, []) == (
        "a photo of a similar object",
        "a photo of a cat",
        "a photo of a dog",
        "a photo of a visual object",
    )
