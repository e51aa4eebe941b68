"""The pieces of the main screen, one module per region."""
