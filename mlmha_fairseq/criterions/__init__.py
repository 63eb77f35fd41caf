"""Training criteria."""
from . import multi_decoder_label_smoothed_cross_entropy  # noqa: F401
