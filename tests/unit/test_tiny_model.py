"""The embedded default model is built locally, deterministically, with no download."""

from rlsync.models import TinyRecipe, build_tiny_model


def test_build_is_deterministic(tmp_path):
    recipe = TinyRecipe(corpus_lines=500)
    a = build_tiny_model(tmp_path / "a", recipe)
    b = build_tiny_model(tmp_path / "b", recipe)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
