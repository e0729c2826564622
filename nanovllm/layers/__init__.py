"""Building blocks of the transformer (chapters 01, 02, 05, 08, 09, 11)."""
