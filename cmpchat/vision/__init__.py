"""Qwen3.5's image input: the mmproj projector file, preprocessing as Qwen's processor does it, the language
model's (t, h, w) positions of image tokens, and the numpy reference encoder (docs/model.md, "Vision")."""
