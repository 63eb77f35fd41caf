"""Models and architectures: the slot Transformer, then one module per paper that fills its
slots and registers the paper's presets; last, each model's options as a hydra config
(:mod:`.hydra_configs`), once every mechanism has declared its options."""
from . import slot_transformer  # noqa: F401
from . import joint_attention  # noqa: F401
from . import mma  # noqa: F401
from . import dual_contextual  # noqa: F401
from . import representation_fusion  # noqa: F401
from . import multi_level_supervision  # noqa: F401
from . import multi_source  # noqa: F401
from .hydra_configs import package_models, register_model_config

for _name, _model in package_models().items():
    register_model_config(_name, _model)
