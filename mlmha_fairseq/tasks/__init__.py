"""Tasks."""
