"""The embedded default model is built locally, deterministically, with no download."""

from rlsync.models import TinyRecipe, build_tiny_model


def test_build_is_deterministic(tmp_path):
    recipe = TinyRecipe(corpus_lines=500)
    a = build_tiny_model(tmp_path / "a", recipe)
    b = build_tiny_model(tmp_path / "b", recipe)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_the_tiny_moe_is_deterministic_and_shares_the_tiny_tokenizer(tmp_path):
    from rlsync.models import TinyMoeRecipe, build_tiny_moe, ensure_tiny_model

    a = build_tiny_moe(tmp_path / "a", TinyMoeRecipe())
    b = build_tiny_moe(tmp_path / "b", TinyMoeRecipe())
    for name in ("model.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "tokenizer.json").read_bytes() == (ensure_tiny_model() / "tokenizer.json").read_bytes()
