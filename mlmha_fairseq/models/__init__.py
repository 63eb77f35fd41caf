"""Models and architectures. Mechanism modules register their slot fillers and options
before the model's ``add_args`` reads them, so they are imported first."""
from . import slot_transformer  # noqa: F401
