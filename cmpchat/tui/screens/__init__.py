"""The main chat screen and the dialogs and overlays it opens."""
