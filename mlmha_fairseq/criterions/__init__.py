"""Training criteria."""
